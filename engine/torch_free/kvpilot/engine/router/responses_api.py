"""OpenAI's Responses API over the engines' chat completions: a request becomes a chat, a chat
completion becomes a Response object (pure functions; `responses_stream.py` does the events).

Served: `input` as text or a list of items (messages with text content, `function_call` and
`function_call_output` items), `instructions` (a system message, not carried to later turns,
as OpenAI's), `previous_response_id` (the conversation so far, from `response_store.py`),
`max_output_tokens`, `temperature`, `top_p` (and kvpilot's `seed`, `top_k`), function
`tools` and `tool_choice`, `text.format` (text, json_object, json_schema), `store`, `stream`,
`metadata`. Refused with a 400 naming the field: other input kinds (images, files, audio),
other tool kinds (web search, file search, ...), `background`, `conversation`, and any
argument the API does not have.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

# arguments taken as they are, or taken only at their do-nothing value
KNOWN = frozenset({"model", "input", "instructions", "previous_response_id", "store", "stream",
                   "max_output_tokens", "temperature", "top_p", "seed", "top_k", "tools",
                   "tool_choice", "parallel_tool_calls", "text", "metadata", "user",
                   "truncation", "background", "include", "reasoning", "service_tier",
                   "stream_options", "conversation", "prompt_cache_key", "safety_identifier"})
INERT = {"background": (None, False), "conversation": (None,), "truncation": (None, "disabled"),
         "include": (None, []), "reasoning": (None, {})}


class ResponsesError(ValueError):
    """A request the Responses API refuses: the status, the field and the message."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesRequest:
    """A checked /v1/responses body, and the chat turns it adds to the conversation."""

    body: dict[str, Any]
    turns: list[dict[str, Any]]  # the input as chat messages (not the instructions)

    @property
    def previous_response_id(self) -> str | None:
        value = self.body.get("previous_response_id")
        return value if isinstance(value, str) else None

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @property
    def store(self) -> bool:
        return self.body.get("store", True) is not False

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Gives the chat completions body: instructions, the stored conversation, the input."""
        b = self.body
        instructions = b.get("instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat: dict[str, Any] = {"model": b["model"], "messages": [*system, *history, *self.turns],
                                "stream": self.stream}
        if self.stream:
            chat["stream_options"] = {"include_usage": True}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("seed", "seed"), ("top_k", "top_k"),
                             ("parallel_tool_calls", "parallel_tool_calls")):
            if b.get(ours) is not None:
                chat[theirs] = b[ours]
        if b.get("tools"):
            chat["tools"] = [{"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters") if k in t}}
                for t in b["tools"]]
        choice = b.get("tool_choice")
        if isinstance(choice, dict):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif choice is not None:
            chat["tool_choice"] = choice
        fmt = (b.get("text") or {}).get("format")
        if fmt and fmt.get("type") == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        return chat


def parse_request(body: Any) -> ResponsesRequest:
    """Gives the checked request; raises ResponsesError naming the first bad field."""
    if not isinstance(body, dict):
        raise ResponsesError("the body must be a JSON object", None)
    for key in body:
        if key not in KNOWN:
            raise ResponsesError(f"Unrecognized request argument supplied: {key}", key)
    for key, allowed in INERT.items():
        if body.get(key) not in allowed:
            raise ResponsesError(f"{key}={body[key]!r} is not supported by kvpilot: remove it",
                                 key)
    if not isinstance(body.get("model"), str):
        raise ResponsesError("model is required: send the served model's name", "model")
    _check_types(body)
    return ResponsesRequest(body, input_turns(body.get("input")))


def _check_types(body: dict[str, Any]) -> None:
    checks: list[tuple[str, type | tuple[type, ...]]] = [
        ("instructions", str), ("previous_response_id", str), ("store", bool),
        ("stream", bool), ("max_output_tokens", int), ("temperature", (int, float)),
        ("top_p", (int, float)), ("seed", int), ("top_k", int), ("tools", list),
        ("tool_choice", (str, dict)), ("parallel_tool_calls", bool), ("text", dict),
        ("metadata", dict)]
    for key, kind in checks:
        value = body.get(key)
        # a bool is an int to Python, never a number to the API
        if value is not None and (not isinstance(value, kind)
                                  or (isinstance(value, bool) and kind is not bool)):
            raise ResponsesError(f"{key}={value!r} has the wrong type", key)
    if isinstance(body.get("max_output_tokens"), int) and body["max_output_tokens"] < 1:
        raise ResponsesError(f"max_output_tokens={body['max_output_tokens']} is invalid: "
                             "send at least 1", "max_output_tokens")
    for i, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ResponsesError(f"tools[{i}].type={kind!r} is not supported by kvpilot: send "
                                 "function tools ({type: function, name, parameters})",
                                 f"tools[{i}].type")
    choice = body.get("tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ResponsesError(f"tool_choice={choice!r} is invalid: none, auto, required or "
                             "{type: function, name}", "tool_choice")
    if isinstance(choice, dict) and not (choice.get("type") == "function"
                                         and isinstance(choice.get("name"), str)):
        raise ResponsesError("tool_choice must name a function: {type: function, name}",
                             "tool_choice")
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ResponsesError(f"text.format.type={kind!r} is invalid: text, json_object or "
                                 "json_schema", "text.format.type")
        if kind == "json_schema" and not isinstance(fmt.get("schema"), dict):
            raise ResponsesError("text.format.schema is required with json_schema: send the "
                                 "JSON schema object", "text.format.schema")


def input_turns(value: Any) -> list[dict[str, Any]]:
    """Gives the chat messages of a Responses `input` (text, or a list of items)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ResponsesError("input is required: send text or a list of input items", "input")
    turns: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ResponsesError(f"input[{i}] must be an object", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append({"role": _role(item, i), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            turns.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}]})
        elif kind == "function_call_output":
            output = item.get("output")
            turns.append({"role": "tool", "tool_call_id": item.get("call_id"),
                          "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ResponsesError(f"input[{i}].type={kind!r} is not supported by kvpilot: send "
                                 "message, function_call or function_call_output items",
                                 f"input[{i}].type")
    return turns


def _role(item: dict[str, Any], i: int) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ResponsesError(f"input[{i}].role={role!r} is invalid: user, assistant, system or "
                             "developer", f"input[{i}].role")
    return "system" if role == "developer" else str(role)


def _text(content: Any, i: int) -> str:
    """Gives a message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"input[{i}].content must be text or a list of parts",
                             f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ResponsesError(f"input[{i}].content[{j}].type={kind!r} is not supported by "
                                 "kvpilot: send input_text parts", f"input[{i}].content[{j}].type")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status != "in_progress" else []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    function = call.get("function") or {}
    return {"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or
            new_id("call"), "name": function.get("name", ""),
            "arguments": function.get("arguments", ""), "status": status}


def output_items(content: str | None, tool_calls: list[dict[str, Any]] | None,
                 message_id: str) -> list[dict[str, Any]]:
    """Gives a reply's output items: its text as a message, then one item per tool call."""
    items = [message_item(message_id, content or "")] if content or not tool_calls else []
    return items + [call_item(c) for c in tool_calls or []]


def response_object(request: ResponsesRequest, response_id: str, created: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    finish_reason: str | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """Gives the Response object OpenAI's clients read."""
    b = request.body
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    if incomplete and status == "completed":
        status = "incomplete"
    fmt = (b.get("text") or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "model": b["model"], "output": output, "error": error, "incomplete_details": incomplete,
        "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
        "previous_response_id": b.get("previous_response_id"),
        "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
        "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
        "parallel_tool_calls": b.get("parallel_tool_calls", True),
        "text": {"format": fmt}, "metadata": b.get("metadata") or {}, "store": request.store,
        "truncation": "disabled", "usage": usage_of(usage) if usage else None,
    }


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Gives the Responses usage of a chat completion's usage."""
    prompt = int(chat_usage.get("prompt_tokens", 0))
    completion = int(chat_usage.get("completion_tokens", 0))
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def from_chat(request: ResponsesRequest, chat: dict[str, Any], response_id: str
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gives (the Response object, the assistant turn to store) of a chat completion."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    content, calls = message.get("content"), message.get("tool_calls") or []
    output = output_items(content, calls, new_id("msg"))
    created = int(chat.get("created") or time.time())
    response = response_object(request, response_id, created, "completed", output,
                               chat.get("usage"), choice.get("finish_reason"))
    return response, assistant_turn(content, calls)


def assistant_turn(content: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Gives the reply as the chat message later turns see."""
    turn: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        turn["tool_calls"] = calls
    return turn
