"""The load generator splits an SSE stream on "\\n" only, whatever text the tokens decode to."""

from __future__ import annotations

import pytest

from kvpilot.engine.loadgen.runner import sse_lines


async def _chunks(parts):
    for part in parts:
        yield part


@pytest.mark.parametrize(("parts", "expected"), [
    (['data: {"t": "a"}\n\n', "data: [DONE]\n\n"], ['data: {"t": "a"}', "", "data: [DONE]", ""]),
    (['data: {"t": "a\u2028b\x85c\x1cd"}\n'], ['data: {"t": "a\u2028b\x85c\x1cd"}']),
    (["da", 'ta: {"t"', ': 1}\r\n', "tail"], ['data: {"t": 1}', "tail"]),
    ([], []),
])
async def test_sse_lines_table(parts, expected):
    assert [line async for line in sse_lines(_chunks(parts))] == expected
