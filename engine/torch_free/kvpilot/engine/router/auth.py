"""The router's authentication: `HttpAuth` (the rules) as a FastAPI dependency, with the body
of a fleet-internal request read up to a bound before anything else looks at it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import HTTPException, Request

from kvpilot.engine.contracts.http_auth import HttpAuth


async def read_bounded(request: Request, limit: int) -> bytes:
    """Gives the request's body; 413 when it is longer than `limit` bytes (read no further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the body has {declared} bytes: send at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the body has more than {limit} bytes: send at most "
                                     f"{limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def authorizer(auth: HttpAuth, max_body: int) -> Callable[[Request], Awaitable[None]]:
    """Gives the app-wide dependency that answers 401 to a request `auth` refuses.

    A fleet-internal request's body (signed with it) is read here, at most `max_body`
    bytes, and left in `request.state.body` for the handler.
    """

    async def authorize(request: Request) -> None:
        path = request.url.path
        body = b""
        if auth.kind(path) == "fleet":
            body = request.state.body = await read_bounded(request, max_body)
        refusal = auth.refusal(request.method, path, request.url.query, request.headers, body)
        if refusal is not None:
            raise HTTPException(401, refusal)

    return authorize
