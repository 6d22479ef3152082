"""The engine server's authentication: `HttpAuth` (the rules) as a FastAPI dependency."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.server.errors import OpenAIError


def authorizer(auth: HttpAuth) -> Callable[[Request], Awaitable[None]]:
    """Gives the app-wide dependency that answers 401 to a request `auth` refuses."""

    async def authorize(request: Request) -> None:
        path = request.url.path
        body = await request.body() if auth.kind(path) == "fleet" else b""
        refusal = auth.refusal(request.method, path, request.url.query, request.headers, body)
        if refusal is not None:
            code = "invalid_fleet_auth" if auth.kind(path) == "fleet" else "invalid_api_key"
            raise OpenAIError(401, refusal, code=code)

    return authorize
