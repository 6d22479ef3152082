"""The router's routes beyond chat and completions: POST /v1/responses (OpenAI's Responses
API over the engines' chat completions, `responses_api.py`, with the conversations of
`previous_response_id` in `response_store.py`), the store's peer lookup, and vLLM's
/tokenize and /detokenize passed to an engine."""

from __future__ import annotations

import json
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.engine.contracts.openai_errors import BodyError, error_object, parse_body
from kvpilot.engine.contracts.router_args import INSTANCE_HEADER, PASSED_HEADERS
from kvpilot.engine.router.fleet import Fleet
from kvpilot.engine.router.flow_control import ClientSide
from kvpilot.engine.router.response_store import STORE_PATH, ResponseStore, tenant_of
from kvpilot.engine.router.responses_api import (
    ResponsesError,
    ResponsesRequest,
    from_chat,
    new_id,
    parse_request,
)
from kvpilot.engine.router.responses_stream import ResponseEvents, response_events

CHAT_PATH = "/v1/chat/completions"


class Router(Protocol):
    """What these routes use of `router.app.Router` (a protocol: app imports this module)."""

    client: httpx.AsyncClient
    fleet: Fleet

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     pinned: str | None, client: ClientSide | None = None) -> Response: ...


def _refusal(exc: ResponsesError) -> JSONResponse:
    return JSONResponse(error_object(exc.status, str(exc), exc.param), exc.status)


def add_responses_routes(app: FastAPI, router: Router, store: ResponseStore) -> None:
    """Adds /v1/responses, the store's peer lookup, /tokenize and /detokenize."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        try:
            body = parse_body(await request.body())
            parsed = parse_request(body)
        except BodyError as exc:
            return JSONResponse(error_object(400, str(exc)), 400)
        except ResponsesError as exc:
            return _refusal(exc)
        tenant = tenant_of(request.headers.get("authorization"))
        history: list[dict[str, Any]] = []
        previous = parsed.previous_response_id
        if previous is not None:
            found = await store.get(previous, tenant, router.client)
            if found is None:
                return _refusal(ResponsesError(
                    f"Previous response with id '{previous}' not found: it expired, was made "
                    "with another API key or with store=false", "previous_response_id", 404))
            history = found
        response_id = new_id("resp")

        def keep(reply: dict[str, Any]) -> None:
            if parsed.store:
                store.put(response_id, tenant, [*history, *parsed.turns, reply])

        headers = {k: v for k, v in request.headers.items() if k in PASSED_HEADERS}
        chat = await router.handle(CHAT_PATH, parsed.chat_body(history), headers,
                                   request.headers.get(INSTANCE_HEADER),
                                   ClientSide(request.headers, request.receive))
        if parsed.stream and isinstance(chat, StreamingResponse) and chat.status_code == 200:
            events = ResponseEvents(parsed, response_id, keep)
            return StreamingResponse(response_events(chat.body_iterator, events),
                                     media_type="text/event-stream", headers=_served(chat))
        return await _whole(chat, parsed, response_id, keep)

    @app.get(STORE_PATH)
    async def response_store(id: str, tenant: str = "") -> Response:
        """A peer router's lookup (fleet-signed): the stored turns of a response."""
        turns = store.local(id, tenant)
        if turns is None:
            return JSONResponse(error_object(404, f"no response {id!r} here"), 404)
        return JSONResponse({"turns": turns})

    async def passed(request: Request) -> Response:
        """Gives an engine's answer to /tokenize or /detokenize (the first ready one)."""
        content = await request.body()
        for instance in router.fleet.available(("both", "decode", "prefill")):
            try:
                answer = await router.client.post(
                    instance.url + request.url.path, content=content,
                    headers={"content-type": "application/json"})
            except httpx.HTTPError:
                continue
            return Response(answer.content, answer.status_code,
                            media_type=answer.headers.get("content-type"))
        return JSONResponse(error_object(503, "no ready instance", code="no_instance"), 503)

    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, passed, methods=["POST"])


def _served(chat: Response) -> dict[str, str]:
    return {k: v for k, v in chat.headers.items() if k.startswith("x-kvpilot")}


async def _whole(chat: Response, parsed: ResponsesRequest, response_id: str,
                 keep: Any) -> Response:
    """Gives the Response object of a whole chat completion, or its error as it came."""
    if isinstance(chat, StreamingResponse):
        raw = b"".join([c if isinstance(c, bytes) else str(c).encode()
                        async for c in chat.body_iterator])
    else:
        raw = bytes(chat.body)
    if chat.status_code != 200:
        return Response(raw, chat.status_code, media_type="application/json",
                        headers=_served(chat))
    if parsed.stream:  # the chat stream did not start (an error before its first byte)
        return Response(raw, chat.status_code, media_type="application/json")
    reply = json.loads(raw)
    response, turn = from_chat(parsed, reply, response_id)
    keep(turn)
    return JSONResponse(response, headers=_served(chat))
