"""The byte-written stream chunks (`server.sse_chunks`) equal what the pydantic models write."""

from __future__ import annotations

import pytest

from kvpilot.engine.contracts.outputs import CompletionOutput
from kvpilot.engine.server.protocol import (
    ChatCompletionChunk,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
)
from kvpilot.engine.server.serving import sse
from kvpilot.engine.server.sse_chunks import ChatChunks, CompletionChunks

# (text, finish_reason, stop_reason): plain, JSON escapes, raw non-ASCII and line separators,
# the empty text of a held-back character, each kind of finish
CASES = [
    (" hello", None, None),
    ('quote " backslash \\ newline \n tab \t nul \x00 bell \x07', None, None),
    ("Zoë 東京 🙂 \u2028 \u0085 \x1c \ud7ff", None, None),
    ("", None, None),
    (" end", "length", None),
    ("", "stop", 2),
    (" bye", "stop", "</s> \"stop\""),
]
ID, CREATED, MODEL = 'cmpl-1"x', 1764170000, 'org/model "q"'


def output(index: int, text: str, finish: str | None, stop: int | str | None
           ) -> CompletionOutput:
    return CompletionOutput(index, text, [1, 2], None, None, finish, stop)


@pytest.mark.parametrize(("text", "finish", "stop"), CASES)
def test_completion_chunk_equals_pydantic(text: str, finish: str | None,
                                          stop: int | str | None) -> None:
    choices = [(index, output(index % 2, text, finish, stop)) for index in (0, 3)]
    expected = sse(CompletionResponse(id=ID, created=CREATED, model=MODEL, choices=[
        CompletionChoice(index=index, text=c.text, logprobs=None, finish_reason=c.finish_reason,
                         stop_reason=c.stop_reason) for index, c in choices]))
    assert CompletionChunks(ID, CREATED, MODEL).event(choices) == expected.encode()


@pytest.mark.parametrize(("text", "finish", "stop"), CASES)
def test_chat_chunk_equals_pydantic(text: str, finish: str | None,
                                    stop: int | str | None) -> None:
    choices = [output(index, text, finish, stop) for index in (0, 1)]
    expected = sse(ChatCompletionChunk(id=ID, created=CREATED, model=MODEL, choices=[
        ChatStreamChoice(index=c.index, delta=ChatDelta(content=c.text or None),
                         finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in choices]))
    assert ChatChunks(ID, CREATED, MODEL).event(choices) == expected.encode()
