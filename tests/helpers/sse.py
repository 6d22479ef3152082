"""A response's lines cut the way SSE cuts them: on "\\n" only.

The engine writes JSON with raw non-ASCII text, and the tiny test models' random
tokens may hold U+2028, U+0085 or \\x1c. `str.splitlines` and httpx's
`iter_lines` cut a line at each of those, so a data line would come out in two
halves that do not parse (a CI run failed on one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx

from kvpilot.engine.loadgen.runner import sse_lines


def lines(text: str) -> list[str]:
    """Gives the lines of a whole SSE body."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def iter_lines(response: httpx.Response) -> Iterator[str]:
    """Gives a streamed response's lines as they arrive."""
    buffer = b""
    for data in response.iter_bytes():
        *done, buffer = (buffer + data).split(b"\n")
        for line in done:
            yield line.removesuffix(b"\r").decode()
    if buffer:
        yield buffer.decode()


async def aiter_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Gives a streamed response's lines as they arrive (async client)."""
    async for line in sse_lines(response.aiter_bytes()):
        yield line.decode()
