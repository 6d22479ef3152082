"""Streamed chunks of the common case (no logprobs, no tools), written as bytes without pydantic.

Building a `CompletionResponse` or `ChatCompletionChunk` and dumping it costs
~5 us per streamed token; with every token of every stream going through it,
that is a tenth of an API server's CPU. These writers give the same bytes
(`tests/server/test_sse_chunks.py` compares them with pydantic's, case by case): the
part that never changes within a stream (id, object, created, model) is encoded
once, and each choice is one msgspec Struct encoded in its fields' order. Chunks
with logprobs, tool calls or usage still go through the pydantic models.
"""

from __future__ import annotations

import msgspec

from kvpilot.engine.contracts.outputs import CompletionOutput

_encode = msgspec.json.Encoder().encode
_TAIL = b'],"usage":null}\n\n'


class _CompletionChoice(msgspec.Struct):
    """`protocol.CompletionChoice` without logprobs, fields in its order."""

    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None


class _ChatDelta(msgspec.Struct):
    """`protocol.ChatDelta` of plain content."""

    role: None
    content: str | None
    tool_calls: None


class _ChatChoice(msgspec.Struct):
    """`protocol.ChatStreamChoice` without logprobs, fields in its order."""

    index: int
    delta: _ChatDelta
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None


def _head(request_id: str, object_name: str, created: int, model: str) -> bytes:
    return (b'data: {"id":' + _encode(request_id) + b',"object":' + _encode(object_name)
            + b',"created":' + str(created).encode() + b',"model":' + _encode(model)
            + b',"choices":[')


class CompletionChunks:
    """Gives the SSE events of one /v1/completions stream's chunks (no logprobs)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = _head(request_id, "text_completion", created, model)

    def event(self, choices: list[tuple[int, CompletionOutput]]) -> bytes:
        """Gives the event carrying (choice index, completion delta) pairs."""
        return self._head + b",".join(
            _encode(_CompletionChoice(index, c.text, None, c.finish_reason, c.stop_reason))
            for index, c in choices) + _TAIL


class ChatChunks:
    """Gives the SSE events of one /v1/chat/completions stream's content chunks."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = _head(request_id, "chat.completion.chunk", created, model)

    def event(self, choices: list[CompletionOutput]) -> bytes:
        """Gives the event carrying each choice's new content (null when it has none)."""
        return self._head + b",".join(
            _encode(_ChatChoice(c.index, _ChatDelta(None, c.text or None, None), None,
                                c.finish_reason, c.stop_reason))
            for c in choices) + _TAIL
