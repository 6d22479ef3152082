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

from kvpilot.engine.contracts.openai_errors import (
    NOT_AN_OBJECT,
    NOT_UTF8,
    error_object,
    invalid_json,
)
from kvpilot.engine.core_process.client import EngineDeadError, RequestAbortedError

logger = logging.getLogger(__name__)

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
    return JSONResponse(error_object(status, message, param, code), status_code=status,
                        headers=headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    # loc is ("body", "messages", 0, "content"); drop "body" and pydantic's union-branch tags.
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and ("[" in p or p in
             {"str", "int", "float", "bool", "list", "dict", "function-after"}))]
    return ".".join(parts) or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Gives the message and param of the first pydantic error, naming field, value and fix."""
    if not errors:
        return NOT_AN_OBJECT, None
    first = errors[0]
    if first.get("type") == "json_invalid":  # loc is ("body", character offset): no field
        loc = first.get("loc", ())
        position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
        return invalid_json(position, str(first.get("ctx", {}).get("error", "?"))), None
    # In a union (a prompt is text or token ids) a field's own check says more than the
    # other branches' type errors: a value error first, then a branch whose type matched
    # but whose bound did not (prompt=[-5]: "greater than or equal to 0", not "a string").
    first = next((e for e in errors if e.get("type") == "value_error"), None) or next(
        (e for e in errors if not str(e.get("type", "")).endswith(("_type", "_parsing"))),
        errors[0])
    param = _param(tuple(first.get("loc", ())))
    if param is None:  # the body itself: not an object, or none sent
        return NOT_AN_OBJECT, None
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
            message = NOT_UTF8  # FastAPI's words for a body json.loads cannot decode
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
