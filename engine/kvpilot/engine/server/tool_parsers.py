"""Tool calls in a model's text: Hermes/Qwen (`<tool_call>{...}</tool_call>`) and Llama 3 JSON.

`--tool-call-parser` picks one (vLLM's names, `hermes` and `llama3_json`). A
parser splits a finished output into the content before the calls and the
calls themselves; `StreamSplitter` does the same for a stream: it passes
content through until the text may start a call, then holds the rest back
until the output ends, when the calls go out as whole `tool_calls` deltas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.contracts.args import TOOL_CALL_PARSERS
from kvpilot.engine.server.protocol_tools import FunctionCall, ToolCall


@dataclass
class ParsedOutput:
    """A finished output: its content (None when only calls) and its tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """Gives the ToolCall of one parsed JSON object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in argument_keys if k in obj), {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=text))


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them."""

    start = "<tool_call>"
    _call_re = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        """Gives the content before the first call and every call that parses."""
        at = text.find(self.start)
        if at < 0:
            return ParsedOutput(text, [])
        calls = []
        for body in self._call_re.findall(text[at:]):
            try:
                call = _call(json.loads(body), ("arguments",))
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if not calls:  # a marker but nothing that parses: the text stays content
            return ParsedOutput(text, [])
        return ParsedOutput(text[:at].strip() or None, calls)

    def call_start(self, text: str) -> int:
        """Gives where a call starts or may start (a marker's prefix at the end), else -1."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for size in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-size:]):
                return len(text) - size
        return -1


class Llama3JsonParser:
    """A reply that is only JSON calls: `{"name": ..., "parameters": {...}}`, `;`-separated,
    optionally after `<|python_tag|>` (kept when special tokens are not skipped)."""

    start = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        """Gives the calls when the whole reply is calls; else the text as content."""
        body = text.strip().removeprefix(self.start).strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        decoder, calls, at = json.JSONDecoder(), [], 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                call = _call(obj, ("parameters", "arguments"))
                if call is None:
                    return ParsedOutput(text, [])
                calls.append(call)
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)

    def call_start(self, text: str) -> int:
        """Gives 0 while the reply may be calls (blank, or opening with `{` or the tag)."""
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.start) \
                or self.start.startswith(head):
            return 0
        return -1


ToolParser = HermesParser | Llama3JsonParser


def make_parser(name: str) -> ToolParser:
    """Gives the parser `--tool-call-parser` names."""
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"--tool-call-parser={name!r} is unknown: use one of "
                     f"{', '.join(TOOL_CALL_PARSERS)}")


class StreamSplitter:
    """Splits one streamed choice into content deltas and, at its end, the tool calls."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` already given as content

    def feed(self, delta: str) -> str:
        """Gives the content of `delta` that can go out now (none once a call may start)."""
        self.text += delta
        at = self.parser.call_start(self.text)
        end = len(self.text) if at < 0 else at
        out, self.sent = self.text[self.sent:end] if end > self.sent else "", max(self.sent, end)
        return out

    def finish(self) -> ParsedOutput:
        """Gives the held-back content (when it held no call) and the calls, at the end."""
        parsed = self.parser.parse(self.text)
        if not parsed.tool_calls:
            return ParsedOutput(self.text[self.sent:] or None, [])
        return ParsedOutput(None, parsed.tool_calls)
