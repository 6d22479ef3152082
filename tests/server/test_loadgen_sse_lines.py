"""The load generator splits an SSE stream on "\\n" only, whatever text the tokens decode to,
and before decoding: a read may end inside a multi-byte character."""

from __future__ import annotations

import pytest

from kvpilot.engine.loadgen.runner import sse_lines

SNOWMAN = "☃".encode()  # three bytes


async def _chunks(parts):
    for part in parts:
        yield part


@pytest.mark.parametrize(("parts", "expected"), [
    ([b'data: {"t": "a"}\n\n', b"data: [DONE]\n\n"],
     [b'data: {"t": "a"}', b"", b"data: [DONE]", b""]),
    (['data: {"t": "a\u2028b\x85c\x1cd"}\n'.encode()], ['data: {"t": "a\u2028b\x85c\x1cd"}'.encode()]),
    ([b"da", b'ta: {"t"', b': 1}\r\n', b"tail"], [b'data: {"t": 1}', b"tail"]),
    ([b'data: "' + SNOWMAN[:1], SNOWMAN[1:] + b'"\n'], [b'data: "' + SNOWMAN + b'"']),
    ([], []),
])
async def test_sse_lines_table(parts, expected):
    assert [line async for line in sse_lines(_chunks(parts))] == expected
