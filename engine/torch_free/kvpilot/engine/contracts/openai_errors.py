"""OpenAI's error object and the request-body refusals, as the engine's API server and the
router both answer them (torch- and framework-free).

One source, so a client sees the same status and the same body whichever of the two refused
its request: the router refuses only what it cannot forward (a body that is not a JSON
object, or too large) and passes every other refusal through from an engine.
"""

from __future__ import annotations

import json
from typing import Any

# OpenAI's error `type` strings per status code.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}

NOT_AN_OBJECT = ("the request body must be a JSON object, e.g. {\"model\": ..., \"prompt\": "
                 "...}: send one with 'Content-Type: application/json'")
NOT_UTF8 = ("the request body is not UTF-8 text: send a JSON object encoded as UTF-8 with "
            "'Content-Type: application/json'")


class BodyError(ValueError):
    """A request body that cannot be read as a JSON object; its message says why and the fix."""


def error_object(status: int, message: str, param: str | None = None,
                 code: str | int | None = None) -> dict[str, Any]:
    """Gives `{"error": {"message", "type", "param", "code"}}` for an answer of `status`."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"),
                      "param": param, "code": code}}


def invalid_json(position: int, reason: str) -> str:
    """Gives the message of a body that is not JSON: where it stops being JSON and why."""
    return (f"the request body is not valid JSON: {reason} at character {position}: "
            "send a JSON object")


def parse_body(raw: bytes) -> dict[str, Any]:
    """Gives the JSON object `raw` holds (Python's reading, as the engine's: NaN and lone
    surrogate escapes pass, for the fields to refuse); raises BodyError otherwise."""
    if not raw:
        raise BodyError(NOT_AN_OBJECT)
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BodyError(invalid_json(exc.pos, exc.msg)) from exc
    except UnicodeDecodeError as exc:
        raise BodyError(NOT_UTF8) from exc
    if not isinstance(body, dict):
        raise BodyError(NOT_AN_OBJECT)
    return body


def encode_body(body: dict[str, Any]) -> bytes:
    """Gives `body` as the JSON bytes an engine parses back to the same object: UTF-8, NaN
    kept (the engine refuses it naming the field), a lone surrogate escaped as `\\udXXX`
    (UTF-8 cannot hold one; the engine refuses it naming the field)."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()
