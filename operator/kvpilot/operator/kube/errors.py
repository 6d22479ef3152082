"""What an API call that failed tells its caller, and whether retrying soon may help."""

from __future__ import annotations

import json

import aiohttp


class KubeError(RuntimeError):
    """An API call failed; the message names the verb, the path and the server's answer."""

    def __init__(self, verb: str, path: str, status: int, text: str) -> None:
        self.status = status
        try:
            detail = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            detail = text
        super().__init__(f"{verb} {path} failed with HTTP {status}: {str(detail)[:300]}")


def transient(exc: BaseException) -> bool:
    """Gives whether an API failure is worth retrying soon (connection trouble, 409/429/5xx)."""
    if isinstance(exc, KubeError):
        return exc.status in (409, 429) or exc.status >= 500
    return isinstance(exc, aiohttp.ClientError | TimeoutError)
