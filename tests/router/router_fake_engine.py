"""A scriptable stand-in for `kvpilot serve`: OpenAI endpoints, /metrics and the KV handoff.

Runs in-process (`FakeEngine.app`) or as its own process
(`python router_fake_engine.py PORT NAME [STREAM_DELAY]`) so a test can SIGKILL it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.core.kv_events import KVEventLog


@dataclass
class FakeEngine:
    """What the fake engine answers, and what it was asked."""

    name: str
    mode: str = "ok"  # ok | fail500 | busy429 | die_after_first | die_mid_event | bad_request
    role: str = "both"
    waiting: float = 0.0
    kv_usage: float = 0.0
    chunks: int = 3
    stream_delay: float = 0.0
    first_delay: float = 0.0  # seconds before a stream's first event (its TTFT)
    metrics_up: bool = True  # False: /metrics answers 503, as an engine still loading
    silent: bool = False  # True: /metrics answers nothing until False again (one down)
    max_num_seqs: int = 0  # exported as kvpilot_max_num_seqs when set
    open_streams: int = 0  # streams being answered now
    peak_streams: int = 0  # the most at once
    bodies: list[dict[str, Any]] = field(default_factory=list)
    authorization: list[str] = field(default_factory=list)  # of each generation request
    kv_events: KVEventLog = field(default_factory=lambda: KVEventLog(1024))  # GET /kv_events
    require: HttpAuth = field(default_factory=HttpAuth)  # what GET /kv_events checks
    # LoRA (max_lora 0: off): vllm:lora_requests_info's labels, and the adapters /v1/models lists
    max_lora: int = 0
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    # migration: a stream's tokens are a function of its prompt (`token_at`), resumed after
    # `resume.token_ids`; it breaks after `break_after` events (0: never) by `break_mode`
    # (die: the connection drops; error503: a 5xx error event, as a drain's handover)
    tokens: bool = False  # streams of `max_tokens` marked tokens (`_token_stream`)
    break_after: int = 0
    break_mode: str = "die"
    resumable_headers: list[str] = field(default_factory=list)  # x-kvpilot-resumable seen

    def app(self) -> FastAPI:
        app = FastAPI()

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.authorization.append(request.headers.get("authorization", ""))
            if self.mode == "fail500":
                return JSONResponse({"error": {"message": "boom"}}, 500)
            if self.mode == "busy429":
                return JSONResponse({"error": {"message": "queue full"}}, 429)
            if self.mode == "bad_request":
                return JSONResponse({"error": {"message": "max_tokens=-1 is invalid"}}, 400)
            if not body.get("stream"):
                choice: dict[str, Any] = {"index": 0, "text": self.name}
                if body.get("return_token_ids"):  # what a prefill engine gives the router
                    choice.update(token_ids=[7], finish_reason="length")
                return JSONResponse({"id": f"cmpl-{self.name}-{len(self.bodies)}",
                                     "created": 1, "model": "tiny", "choices": [choice]})
            self.resumable_headers.append(request.headers.get("x-kvpilot-resumable", ""))
            if self.tokens:
                return StreamingResponse(self._token_stream(body, request), media_type=
                                         "text/event-stream")
            return StreamingResponse(self._stream(), media_type="text/event-stream")

        app.add_api_route("/v1/completions", generate, methods=["POST"])
        app.add_api_route("/v1/chat/completions", generate, methods=["POST"])

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            cards = [{"id": name, "object": "model", "parent": "tiny"} for name in self.adapters]
            return {"object": "list", "data": [{"id": "tiny", "object": "model"}, *cards]}

        @app.get("/metrics")
        async def metrics() -> Response:
            while self.silent:  # the router hears nothing from it: it has not come back
                await asyncio.sleep(0.02)
            if not self.metrics_up:
                return Response("loading", status_code=503)
            text = (f'vllm:num_requests_waiting{{model_name="tiny"}} {self.waiting}\n'
                    f'vllm:kv_cache_usage_perc{{model_name="tiny"}} {self.kv_usage}\n'
                    f'vllm:num_requests_running{{model_name="tiny"}} 0.0\n')
            if self.max_num_seqs:
                text += f'kvpilot_max_num_seqs{{model_name="tiny"}} {self.max_num_seqs}\n'
            if self.max_lora:
                text += (f'vllm:lora_requests_info{{running_lora_adapters='
                         f'"{",".join(self.running_loras)}",waiting_lora_adapters='
                         f'"{",".join(self.waiting_loras)}",max_lora="{self.max_lora}"}} '
                         f'{time.time()}\n')
            return Response(text, media_type="text/plain")

        @app.get("/kv_events")
        async def kv_events(request: Request, since: int = 0) -> Response:
            if self.require.refusal("GET", "/kv_events", request.url.query, request.headers):
                return JSONResponse({"error": {"message": "unauthenticated"}}, 401)
            return JSONResponse(self.kv_events.read(since))

        return app

    async def _token_stream(self, body: dict[str, Any], request: Request):
        """A completions stream of `max_tokens` tokens, each event one token (its text
        `<id>`), marked when the router asks; a `resume` starts after its tokens."""
        prompt = str(body.get("prompt") or body.get("messages"))
        resume = body.get("resume") or {}
        done = list(resume.get("token_ids", []))
        assert done == [token_at(prompt, i) for i in range(len(done))], "a wrong resume"
        rid = request.headers.get("x-kvpilot-request-id") or f"cmpl-{self.name}"
        created = resume.get("created") or 100
        marked = request.headers.get("x-kvpilot-resumable") == "1"
        for sent, i in enumerate(range(len(done), body["max_tokens"])):
            if self.break_after and sent == self.break_after:
                if self.break_mode == "die":
                    raise RuntimeError("engine died mid-stream")
                error = {"error": {"message": "the server is draining and handed this stream "
                                   "over", "type": "ServiceUnavailable", "code": 503}}
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                return
            token = token_at(prompt, i)
            last = i == body["max_tokens"] - 1
            chunk = {"id": rid, "object": "text_completion", "created": created,
                     "model": "tiny", "choices": [{"index": 0, "text": f"<{token}>",
                                                   "finish_reason": "length" if last else None}]}
            mark = f": token_ids {token}\n" if marked else ""
            yield f"{mark}data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(self.stream_delay)
        usage = {"id": rid, "object": "text_completion", "created": created, "model": "tiny",
                 "choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

    async def _stream(self):
        self.open_streams += 1
        self.peak_streams = max(self.peak_streams, self.open_streams)
        try:
            async for event in self._events():
                yield event
        finally:
            self.open_streams -= 1

    async def _events(self):
        await asyncio.sleep(self.first_delay)
        for i in range(self.chunks):
            chunk = {"choices": [{"index": 0, "text": f"{self.name}:{i}"}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if self.mode == "die_after_first":
                raise RuntimeError("engine died mid-stream")
            if self.mode == "die_mid_event":  # half of the next event, then gone
                yield f"data: {json.dumps(chunk)}"[:20].encode()
                raise RuntimeError("engine died mid-event")
            await asyncio.sleep(self.stream_delay)
        yield b"data: [DONE]\n\n"


def token_at(prompt: str, i: int) -> int:
    """Gives the fake engines' i-th output token for `prompt` (the same on every one)."""
    return (sum(map(ord, prompt)) * 31 + i * 7) % 1000


@contextlib.asynccontextmanager
async def serving(app: Any, servers: list[uvicorn.Server] | None = None) -> AsyncIterator[str]:
    """Runs `app` on a free 127.0.0.1 port; gives its base URL. Given `servers`, adds its
    server there, so a fixture of several can ask them all to stop at once (see `stop_all`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    if servers is not None:
        servers.append(server)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


def stop_all(servers: list[uvicorn.Server]) -> None:
    """Asks every server to stop; `serving` then awaits each. A uvicorn server stops at its
    next 0.1 s tick and polls its closing connections every 0.1 s: one after another, a
    fleet's four took ~0.5 s of every test's teardown."""
    for server in servers:
        server.should_exit = True


if __name__ == "__main__":
    port, name = int(sys.argv[1]), sys.argv[2]
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    engine = FakeEngine(name, chunks=10_000, stream_delay=delay)
    uvicorn.run(engine.app(), host="127.0.0.1", port=port, log_level="warning")
