"""The tool calls of a chat reply: parsed from the text (`auto`) or read from the JSON the
grammar forced (`required`, a named function), whole or as a stream of deltas.

`ToolReply.of` says how a request's reply carries calls, or None when it is
plain content (no tools, or `tool_choice="none"`). A streamed reply passes its
content through as it comes and sends the calls when the choice ends: OpenAI's
clients join `tool_calls` deltas by index, so whole calls are valid deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import ChatCompletionRequest
from kvpilot.engine.server.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvpilot.engine.server.structured import named_tool
from kvpilot.engine.server.tool_parsers import (
    ParsedOutput,
    StreamSplitter,
    ToolParser,
    make_parser,
)


def _required_calls(text: str) -> ParsedOutput:
    """Gives the calls of a `required` reply (a JSON list of {name, parameters})."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:  # cut by max_tokens: the text stays content
        return ParsedOutput(text, [])
    return ParsedOutput(None, [
        ToolCall(function=FunctionCall(name=item["name"], arguments=json.dumps(
            item["parameters"], ensure_ascii=False))) for item in items])


@dataclass
class ToolReply:
    """How one request's reply carries tool calls, and one choice's stream state."""

    parser: ToolParser | None  # auto: the --tool-call-parser
    named: str | None  # a named tool_choice: the reply is that function's arguments
    splitters: dict[int, StreamSplitter] = field(default_factory=dict)
    held: dict[int, str] = field(default_factory=dict)  # forced replies, by choice index
    ended_in_calls: dict[int, bool] = field(default_factory=dict)  # streamed choices that did

    @classmethod
    def of(cls, request: ChatCompletionRequest, tool_call_parser: str | None
           ) -> ToolReply | None:
        """Gives the request's tool reply mode; 400 when `auto` has no parser on this server."""
        if not request.tools or request.tool_choice == "none":
            return None
        tool = named_tool(request)
        if tool is not None:
            return cls(None, tool.function.name)
        if request.tool_choice == "required":
            return cls(None, None)
        if tool_call_parser is None:
            raise bad_request(
                "tool_choice=auto (the default with tools) needs the server started with "
                "--enable-auto-tool-choice --tool-call-parser: start it so, or send "
                "tool_choice=required, a named function or none", "tool_choice")
        return cls(make_parser(tool_call_parser), None)

    def parse(self, text: str) -> ParsedOutput:
        """Gives a finished reply's content and calls."""
        if self.parser is not None:
            return self.parser.parse(text)
        if self.named is not None:
            return ParsedOutput(None, [ToolCall(function=FunctionCall(name=self.named,
                                                                      arguments=text))])
        return _required_calls(text)

    def finish_reason(self, parsed: ParsedOutput, reason: str | None) -> str | None:
        """Gives OpenAI's finish reason: "tool_calls" when a free reply ended in calls."""
        return "tool_calls" if parsed.tool_calls and reason == "stop" and self.named is None \
            else reason

    def feed(self, index: int, text: str) -> str:
        """Gives the content of choice `index`'s new `text` that can be streamed now."""
        if self.parser is None:  # a forced reply is all call: hold it to the end
            self.held[index] = self.held.get(index, "") + text
            return ""
        splitter = self.splitters.setdefault(index, StreamSplitter(self.parser))
        return splitter.feed(text)

    def finish(self, index: int) -> tuple[str | None, list[DeltaToolCall]]:
        """Gives choice `index`'s held-back content and its calls as deltas, at its end."""
        if self.parser is None:
            parsed = self.parse(self.held.pop(index, ""))
        else:
            splitter = self.splitters.pop(index, None)
            parsed = splitter.finish() if splitter else ParsedOutput(None, [])
        self.ended_in_calls[index] = bool(parsed.tool_calls)
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name,
                                                           arguments=c.function.arguments))
                  for i, c in enumerate(parsed.tool_calls)]
        return parsed.content, deltas
