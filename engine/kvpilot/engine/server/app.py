"""The FastAPI application: OpenAI routes, health and readiness probes, and /metrics.

Handlers are thin: they validate, admit through the drain gate, and hand the
work to `completions` / `chat`, which talk to the engine core process only
through `CoreClient`. Nothing here imports torch: an API server process starts
in about a second, whatever the engine core is loading.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.request_limits import BodyLimit, RequestLimits
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.contracts.version import kvpilot_version
from kvpilot.engine.core_process.client import CoreClient
from kvpilot.engine.core_process.launch import CoreHandle
from kvpilot.engine.server.auth import authorizer
from kvpilot.engine.server.chat import create_chat_completion
from kvpilot.engine.server.completions import create_completion
from kvpilot.engine.server.drain import Gate
from kvpilot.engine.server.errors import OpenAIError, install_error_handlers
from kvpilot.engine.server.lora_routes import adapter_cards, add_lora_routes
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.params import Limits
from kvpilot.engine.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvpilot.engine.server.serving import ServingContext
from kvpilot.engine.server.tokenize_routes import add_tokenize_routes

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in ((400, "invalid request (param names the field)"),
                         (401, "missing or wrong API key (or fleet signature on /kv_events)"),
                         (404, "unknown model"),
                         (429, "waiting queue full; see Retry-After"),
                         (503, "draining or engine failed"))}


def build_app(core: CoreHandle, tokenizer: TokenizerLike, model_name: str,
              max_queue_len: int = 1024, auth: HttpAuth | None = None,
              tool_call_parser: str | None = None, max_request_bytes: int = 0,
              max_prompt_chars: int = 0) -> FastAPI:
    """Gives the app serving the engine `core` under `model_name`; it connects while starting
    and disconnects while stopping (the core's life is its launcher's).

    `auth` says which credential each path needs (`contracts.http_auth`; none: all open);
    `tool_call_parser` (with --enable-auto-tool-choice) parses tool calls of tool_choice=auto;
    the two limits (0: sized from the model, `contracts.request_limits`) bound a request.
    """
    metrics = ServerMetrics(model_name)
    client = CoreClient(core, tokenizer, metrics)
    gate = Gate(max_queue_len, lambda: client.stats.num_waiting + client.num_pending,
                on_drain=metrics.set_draining)
    sizes = RequestLimits.for_model(core.ready.max_model_len, tokenizer.max_token_chars,
                                    max_request_bytes, max_prompt_chars)
    limits = Limits(max_model_len=core.ready.max_model_len, vocab_size=core.ready.vocab_size,
                    max_prompt_chars=sizes.max_prompt_chars)
    ctx = ServingContext(client, tokenizer, model_name, limits, gate, tool_call_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            ctx.shutdown()
            await client.close()

    app = FastAPI(title="kvpilot engine", version="0.1.0", lifespan=lifespan,
                  dependencies=[Depends(authorizer(auth or HttpAuth()))])
    app.state.ctx = ctx
    app.state.metrics = metrics
    app.state.request_limits = sizes
    app.add_middleware(BodyLimit, max_bytes=sizes.max_request_bytes)
    install_error_handlers(app)

    def lora_of(name: str) -> str | None:
        """Gives the LoRA adapter `model` names (None: the base model); the core refuses
        an adapter it does not serve (400 naming `model`)."""
        if name == model_name:
            return None
        if core.ready.enable_lora:
            return name
        raise OpenAIError(404, f"model={name!r} does not exist: this server serves "
                               f"{model_name!r}", param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        """200 while the process and its engine core are alive."""
        if client.dead:
            return JSONResponse({"status": "engine failed"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """200 when the model is loaded and the server is not draining; 503 otherwise."""
        if gate.draining or client.dead:
            reason = "draining" if gate.draining else "engine failed"
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's route: the server's version."""
        return {"version": kvpilot_version()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv_events")
    async def kv_events(since: int = 0) -> Response:
        """Gives the prefix cache's events since `since`: {"next": M, "events": [...]}.

        The router polls this with `since` = the last answer's `next`, signed with the
        fleet secret (`contracts.http_auth`). The core reads its log between steps (see
        `kvpilot.engine.core.kv_events`).
        """
        return JSONResponse(await client.kv_events(since))

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> ModelList:
        base = ModelCard(id=model_name, root=core.ready.model, max_model_len=limits.max_model_len)
        adapters = await adapter_cards(client, model_name) if core.ready.enable_lora else []
        return ModelList(data=[base, *adapters])

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": CompletionResponse}, **ERRORS})
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await create_completion(body, raw, ctx, lora_of(body.model))

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse}, **ERRORS})
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(body, raw, ctx, lora_of(body.model))

    add_lora_routes(app, client)
    add_tokenize_routes(app, ctx)
    return app
