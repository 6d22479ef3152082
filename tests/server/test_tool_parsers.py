"""Tool-call parsers (hermes, llama3_json) and the stream splitter, as tables of cases."""

from __future__ import annotations

import json

import pytest

from kvpilot.engine.server.tool_parsers import StreamSplitter, make_parser

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}

# (parser, model text, expected content, expected [(name, arguments dict)])
CASES = [
    ("hermes", "plain answer", "plain answer", []),
    ("hermes", f"<tool_call>{json.dumps(CALL)}</tool_call>", None,
     [("get_weather", {"city": "Paris"})]),
    ("hermes", f"Let me check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>"
     '{"name": "now", "arguments": {}}</tool_call>', "Let me check.",
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("hermes", f"<tool_call>{json.dumps(CALL)}", None, [("get_weather", {"city": "Paris"})]),
    ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
     '"arguments": {"x": 1}}', None, [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("llama3_json", '{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse_splits_content_and_calls(parser: str, text: str, content: str | None,
                                        calls: list[tuple[str, dict]]) -> None:
    parsed = make_parser(parser).parse(text)
    assert parsed.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] \
        == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_pieces_give_the_same_content_and_calls(
        parser: str, text: str, content: str | None, calls: list[tuple[str, dict]],
        piece: int) -> None:
    splitter = StreamSplitter(make_parser(parser))
    streamed = "".join(splitter.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    end = splitter.finish()
    whole = (streamed + (end.content or "")) or None
    if calls:  # the content before the calls went out as it came (whitespace kept)
        assert (whole or "").strip() == (content or "")
    else:
        assert whole == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in end.tool_calls] \
        == calls


def test_hermes_stream_never_sends_part_of_the_marker() -> None:
    splitter = StreamSplitter(make_parser("hermes"))
    sent = [splitter.feed(p) for p in ["Hi <", "tool", "_call>", json.dumps(CALL), "</tool_call>"]]
    assert sent == ["Hi ", "", "", "", ""]
    assert splitter.finish().tool_calls[0].function.name == "get_weather"


def test_unknown_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser='mistral'"):
        make_parser("mistral")
