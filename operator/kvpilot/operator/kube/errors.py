"""What an API call that failed tells its caller, and whether retrying soon may help."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import aiohttp

_MANAGER = re.compile(r'conflict with "([^"]*)"')


class KubeError(RuntimeError):
    """An API call failed; the message names the verb, the path and the server's answer."""

    def __init__(self, verb: str, path: str, status: int, text: str) -> None:
        self.status = status
        try:
            detail = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            detail = text
        super().__init__(f"{verb} {path} failed with HTTP {status}: {str(detail)[:300]}")


@dataclass(frozen=True)
class Conflict:
    """One field a server-side apply would have changed under another field manager."""

    field: str
    """The field's path as the API server prints it, e.g. `.spec.replicas`."""
    manager: str
    """The field manager that owns it now, e.g. `kubectl-edit`."""


def conflicts_in(text: str) -> list[Conflict]:
    """Gives the field-manager conflicts a 409 Status body lists (none for other 409s)."""
    try:
        causes = (json.loads(text).get("details") or {}).get("causes") or []
    except (ValueError, AttributeError):
        return []
    out = []
    for cause in causes:
        if cause.get("reason") != "FieldManagerConflict":
            continue
        found = _MANAGER.search(cause.get("message", ""))
        out.append(Conflict(cause.get("field", ""), found.group(1) if found else "unknown"))
    return out


class FieldConflict(KubeError):
    """A server-side apply was refused: fields it sets belong to other managers (HTTP 409)."""

    def __init__(self, verb: str, path: str, text: str, conflicts: list[Conflict]) -> None:
        super().__init__(verb, path, 409, text)
        self.conflicts = conflicts


def transient(exc: BaseException) -> bool:
    """Gives whether an API failure is worth retrying soon (connection trouble, 409/429/5xx)."""
    if isinstance(exc, KubeError):
        return exc.status in (409, 429) or exc.status >= 500
    return isinstance(exc, aiohttp.ClientError | TimeoutError)
