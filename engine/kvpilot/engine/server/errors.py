"""OpenAI-style errors: one exception type and the handlers that render every error as one.

Clients (the openai SDK included) read `{"error": {"message", "type", "param", "code"}}`
and map the HTTP status to an exception class, so every failure path (pydantic
validation, engine ValueErrors, unknown routes, crashes) answers in that shape.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.core_process.client import EngineDeadError, RequestAbortedError
from kvpilot.engine.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's error `type` strings per status code.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

# Engine and SamplingParams errors read "<field>=<value> is invalid: ..."; the field is the param.
_FIELD = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=")


class OpenAIError(Exception):
    """An error the server answers with status `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """Gives a 400 naming `param`."""
    return OpenAIError(400, message, param=param)


def from_value_error(exc: ValueError) -> OpenAIError:
    """Gives a 400 whose param is the field named at the start of the engine's message."""
    message = str(exc)
    match = _FIELD.match(message)
    return OpenAIError(400, message, param=match.group(1) if match else None)


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    """Gives the JSON response carrying OpenAI's error object."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"),
                                         param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    # loc is ("body", "messages", 0, "content"); drop "body" and pydantic's union-branch tags.
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and ("[" in p or p in
             {"str", "int", "float", "bool", "list", "dict", "function-after"}))]
    return ".".join(parts) or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Gives the message and param of the first pydantic error, naming field, value and fix."""
    if not errors:
        return "invalid request body", None
    # In a union (a prompt is text or token ids) a field's own check says more than the
    # other branches' type errors.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    param = _param(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid" or param is None:
        return f"invalid request body: {first.get('msg')}; send a JSON object", param
    value = first.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    if first.get("type") == "missing":
        return f"{param} is required: add it to the request body", param
    return f"{param}={shown} is invalid: {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
    """Makes every error of `app` answer in OpenAI's format (400, not FastAPI's 422)."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), code="engine_dead")

    @app.exception_handler(RequestAbortedError)
    async def _aborted(_: Request, exc: RequestAbortedError) -> JSONResponse:
        return error_response(503, str(exc), code="aborted")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = ("request body cannot be parsed: send a JSON object with "
                       "'Content-Type: application/json'")
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
