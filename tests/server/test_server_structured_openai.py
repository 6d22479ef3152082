"""The openai client's `response_format` and `tools` round-trip against a tiny-llama server.

The weights are random, so only the grammar makes replies parse: a json_schema
reply validates, a named or required tool_choice gives calls whose arguments
validate, and tool_choice=auto parses the Hermes calls the model writes (forced
here through `structured_outputs` so a random model writes one). Each case runs
whole and streamed; the template renders `tools` and tool turns (Hermes style).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import MODEL, RunningCore, RunningServer, serve_in_thread

from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.server.app import build_app
from kvpilot.engine.server.params import Limits, chat_prompt
from kvpilot.engine.server.protocol import ChatCompletionRequest

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}\n{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
COMMON: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200,
                          "temperature": 1.0}


class Answer(BaseModel):
    colour: Literal["red", "green"]
    count: int = Field(ge=0, le=99)
    tags: list[Literal["x", "y"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def tool_server(core: RunningCore) -> Iterator[RunningServer]:
    tokenizer = load_tokenizer(MODEL)
    tokenizer.chat_template = HERMES_TEMPLATE
    with serve_in_thread(build_app(core.handle, tokenizer, MODEL,
                                   tool_call_parser="hermes")) as running:
        yield running


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def streamed(server: RunningServer, **kwargs: Any) -> tuple[str, list[dict[str, str]], str]:
    """Gives a streamed reply's content, its tool calls joined by index, its finish reason."""
    content, calls, reason = "", {}, ""
    for chunk in client(server).chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += (d.function and d.function.name) or ""
            call["arguments"] += (d.function and d.function.arguments) or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("seed", [0, 1])
def test_parse_with_a_pydantic_response_format(tool_server: RunningServer, seed: int) -> None:
    out = client(tool_server).chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=200, seed=seed, response_format=Answer)
    assert isinstance(out.choices[0].message.parsed, Answer)


def test_json_schema_reply_streams_valid_json(tool_server: RunningServer) -> None:
    # closed, as openai's `parse` sends it (strict): no unbounded extra keys
    schema = {**Answer.model_json_schema(), "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    content, calls, reason = streamed(tool_server, response_format=fmt, seed=3, **COMMON)
    jsonschema.validate(json.loads(content), schema)
    assert (calls, reason) == ([], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_a_call_whose_arguments_validate(tool_server: RunningServer,
                                                                 stream: bool) -> None:
    kwargs = {**COMMON, "tools": TOOLS, "seed": 5,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if stream:
        content, calls, _ = streamed(tool_server, **kwargs)
    else:
        message = client(tool_server).chat.completions.create(**kwargs).choices[0].message
        content = message.content or ""
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls or [] if c.type == "function"]
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_calls_of_known_tools(tool_server: RunningServer,
                                                         stream: bool, parallel: bool) -> None:
    # a random model's list of calls ends when it picks "]" over ",": seed 0 ends in time
    kwargs = {**COMMON, "tools": TOOLS, "tool_choice": "required", "seed": 0,
              "parallel_tool_calls": parallel}
    if stream:
        _, calls, reason = streamed(tool_server, **kwargs)
    else:
        choice = client(tool_server).chat.completions.create(**kwargs).choices[0]
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or [] if c.type == "function"]
        reason = choice.finish_reason
    assert calls and reason == "tool_calls"
    assert parallel or len(calls) == 1
    for call in calls:
        arguments = json.loads(call["arguments"])
        if call["name"] == "get_weather":
            jsonschema.validate(arguments, WEATHER)
        else:
            assert (call["name"], arguments) == ("now", {})


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_hermes_calls_written(tool_server: RunningServer,
                                                          stream: bool) -> None:
    regex = (r'Checking\.<tool_call>\{"name": "get_weather", "arguments": '
             r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>')
    kwargs = {**COMMON, "tools": TOOLS, "seed": 1,
              "extra_body": {"structured_outputs": {"regex": regex}}}
    if stream:
        content, calls, reason = streamed(tool_server, **kwargs)
    else:
        choice = client(tool_server).chat.completions.create(**kwargs).choices[0]
        content, reason = choice.message.content or "", choice.finish_reason
        calls = [{"name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or [] if c.type == "function"]
    assert content == "Checking."
    assert [c["name"] for c in calls] == ["get_weather"] and reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_tool_choice_none_replies_in_plain_text(tool_server: RunningServer) -> None:
    choice = client(tool_server).chat.completions.create(
        **{**COMMON, "max_tokens": 5}, tools=TOOLS, tool_choice="none").choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")


def test_template_renders_tools_and_tool_turns() -> None:
    tokenizer = load_tokenizer(MODEL)
    tokenizer.chat_template = HERMES_TEMPLATE
    request = ChatCompletionRequest.model_validate({"model": MODEL, "tools": TOOLS, "messages": [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    text = tokenizer.decode(chat_prompt(request, tokenizer, Limits(4096, 1024)),
                            skip_special_tokens=False)
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
            '</tool_call>') in text
    assert "<tool_response>sunny</tool_response>" in text
