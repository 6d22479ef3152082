"""What completions and chat share: starting engine requests, merging their streams,
SSE framing, usage, logprob conversion and aborting when the client goes away.

A streamed request's outputs arrive as deltas (the text, tokens and logprobs
new since the last one); a non-streamed request's as one final output.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import re
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvpilot.engine.contracts.openai_errors import error_object
from kvpilot.engine.contracts.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from kvpilot.engine.contracts.router_args import REQUEST_ID_HEADER
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core_process.client import (
    CoreClient,
    EngineDeadError,
    OutputStream,
    RequestAbortedError,
)
from kvpilot.engine.server.drain import Gate
from kvpilot.engine.server.errors import (
    OpenAIError,
    bad_request,
    from_value_error,
)
from kvpilot.engine.server.params import Limits
from kvpilot.engine.server.protocol import UsageInfo

T = TypeVar("T")


# Threads that tokenise (and render chats): one core fewer than the machine has, so the
# event loop keeps one while long prompts are tokenised (measured in
# tests/server/test_server_availability.py; the tokenizer releases the GIL, see
# `contracts.tokenizer.GIL_FREE_CHARS`).
TOKENIZE_THREADS = max(1, (os.cpu_count() or 2) - 1)
# A prompt of this many characters or more (~1/4 s of tokenising, ~16k tokens) is tokenised
# on a thread of its own kind: long prompts wait for each other, never short ones for them.
LARGE_PROMPT_CHARS = 65_536
P = ParamSpec("P")
# glibc keeps what a thread freed in that thread's arena: after a 2 MB prompt the API server
# held 407 MiB instead of 70 (tests/server/test_server_big_prompts.py); trimming gives it back.
# None off glibc (musl, macOS), whose allocators return large blocks themselves.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _pool(threads: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix=name)


def _then_trim(function: Callable[[], T]) -> T:
    """Gives `function()`, then returns the allocator's free pages to the system."""
    try:
        return function()
    finally:
        if _MALLOC_TRIM is not None:
            _MALLOC_TRIM(0)


@dataclass
class ServingContext:
    """What a generation handler needs from the server."""

    engine: CoreClient
    tokenizer: TokenizerLike
    model_name: str
    limits: Limits
    gate: Gate
    tool_call_parser: str | None = None  # with --enable-auto-tool-choice: tool_choice=auto
    cpu: ThreadPoolExecutor = field(
        default_factory=lambda: _pool(TOKENIZE_THREADS, "kvpilot-tokenize"))
    cpu_large: ThreadPoolExecutor = field(
        default_factory=lambda: _pool(1, "kvpilot-tokenize-large"))
    # ids of the streams in flight that a router can resume elsewhere (`stream_resume`):
    # a drain hands them over
    resumable: set[str] = field(default_factory=set)

    async def off_loop(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Gives `function`'s result, run in a tokenising thread (CPU work off the loop)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.cpu, functools.partial(function, *args, **kwargs))

    async def tokenising(self, chars: int, function: Callable[P, T], *args: P.args,
                         **kwargs: P.kwargs) -> T:
        """Gives `function`'s result, run off the loop on the pool for prompts of `chars`
        characters: the large-prompt thread from LARGE_PROMPT_CHARS on."""
        call = functools.partial(function, *args, **kwargs)
        loop = asyncio.get_running_loop()
        if chars < LARGE_PROMPT_CHARS:
            return await loop.run_in_executor(self.cpu, call)
        return await loop.run_in_executor(self.cpu_large, _then_trim, call)

    def shutdown(self) -> None:
        """Stops the tokenising threads (queued work is dropped)."""
        for pool in (self.cpu, self.cpu_large):
            pool.shutdown(wait=False, cancel_futures=True)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def given_request_id(raw: Request) -> str | None:
    """Gives the request's `x-kvpilot-request-id` header (set by the router: the id of the
    engine request and of the response), None without one; a 400 naming the header when it
    is malformed."""
    value = raw.headers.get(REQUEST_ID_HEADER)
    if value is not None and not _REQUEST_ID.fullmatch(value):
        raise bad_request(f"{REQUEST_ID_HEADER}={value[:40]!r} is invalid: send 1-128 "
                          "letters, digits or ._:-", REQUEST_ID_HEADER)
    return value


async def start_requests(ctx: ServingContext, request_id: str, prompts: list[list[int]],
                         params: list[SamplingParams], arrival_time: float, priority: int,
                         stream: bool, lora_name: str | None = None) -> list[OutputStream]:
    """Gives one output stream per prompt; on a refusal aborts the ones started and raises 400."""
    streams: list[OutputStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await ctx.engine.add_request(rid, ids, p, arrival_time=arrival_time,
                                                        priority=priority, stream=stream,
                                                        lora_name=lora_name))
    except ValueError as exc:
        await close_all(streams)
        raise from_value_error(exc) from exc
    except EngineDeadError as exc:
        await close_all(streams)
        raise OpenAIError(503, str(exc), code="engine_dead") from exc
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def admit_requests(ctx: ServingContext, prefix: str, prompts: list[list[int]],
                         params: list[SamplingParams], arrival_time: float, priority: int,
                         stream: bool, lora_name: str | None = None,
                         request_id: str | None = None) -> tuple[str, list[OutputStream]]:
    """Gives (request id, one output stream per prompt) once the drain gate admits the request.

    From here the gate slot is the caller's to give back (GenerationStream or a `finally`);
    if starting the requests fails, it is given back here.
    """
    if request_id is not None and ctx.engine.has_request(request_id):
        raise bad_request(f"{REQUEST_ID_HEADER}={request_id!r} is already running: send a "
                          "unique id", REQUEST_ID_HEADER)
    ctx.gate.admit()
    try:
        request_id = request_id or new_request_id(prefix)
        return request_id, await start_requests(ctx, request_id, prompts, params, arrival_time,
                                                priority, stream, lora_name)
    except BaseException:
        ctx.gate.release()
        raise


class StreamUsage:
    """What a stream has sent so far: its choices' characters, and tokens for `usage`."""

    def __init__(self, prompt_lens: list[int]) -> None:
        self.prompt_tokens = sum(prompt_lens)
        self.tokens = [0] * len(prompt_lens)  # completion tokens sent, per prompt
        self.cached_tokens = [0] * len(prompt_lens)
        self._chars: dict[int, int] = {}  # per choice index

    def add(self, prompt: int, output: RequestOutput) -> None:
        """Counts the tokens of one delta of prompt number `prompt`."""
        self.tokens[prompt] += sum(len(c.token_ids) for c in output.outputs)
        self.cached_tokens[prompt] = output.num_cached_tokens

    def text_offset(self, index: int, completion: CompletionOutput) -> int:
        """Gives where choice `index`'s new text starts in its whole text, counting it sent."""
        start = self._chars.get(index, 0)
        self._chars[index] = start + len(completion.text)
        return start

    def usage(self) -> UsageInfo:
        completion = sum(self.tokens)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.prompt_tokens + completion,
                         prompt_tokens_details={"cached_tokens": sum(self.cached_tokens)})


async def close_all(streams: Sequence[AsyncGenerator[object, None]]) -> None:
    """Closes streams, which aborts their unfinished requests."""
    for stream in streams:
        with contextlib.suppress(RuntimeError):  # already running elsewhere: it closes itself
            await stream.aclose()


class GenerationStream(StreamingResponse):
    """An SSE response that always gives back its gate slot and closes its engine streams.

    Cleaning up here, not only in the body generator, also covers a client that
    leaves before the generator ever started (a never-started generator runs no
    `finally`).
    """

    def __init__(self, body: AsyncGenerator[str | bytes, None], gate: Gate,
                 streams: list[OutputStream], resumable: set[str] | None = None,
                 request_id: str = "") -> None:
        super().__init__(body, media_type="text/event-stream")
        self._body = body
        self._gate = gate
        self._streams = streams
        self._resumable = resumable  # where it is listed while it runs, if a router may move it
        self._request_id = request_id
        if resumable is not None:
            resumable.add(request_id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await close_all(self._streams)
            if self._resumable is not None:
                self._resumable.discard(self._request_id)
            self._gate.release()


async def merge(streams: list[AsyncGenerator[T, None]]
                ) -> AsyncGenerator[tuple[int, T], None]:
    """Gives (stream index, item) from all streams as items arrive; closing it closes them."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await close_all(streams)
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Gives `work`'s result, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise OpenAIError(499, "client disconnected")
    return task.result()


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """Gives one server-sent event carrying `payload` as JSON (or a raw string like [DONE])."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    """Gives the SSE event that tells a streaming client its request failed."""
    status = exc.status if isinstance(exc, OpenAIError) else 500
    if isinstance(exc, EngineDeadError | RequestAbortedError):
        status = 503
    return sse(error_object(status, str(exc), getattr(exc, "param", None), code=status))


def usage_of(finals: list[RequestOutput | None], prompt_lens: list[int]) -> UsageInfo:
    """Gives the token usage of finished outputs (prompts counted once, every completion)."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for out in finals if out for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals if out)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})


def check_error(output: RequestOutput, had_tokens: bool = False) -> None:
    """Raises when the engine ended the request with an error.

    An error before any token (`had_tokens`: earlier deltas had some) is the engine
    refusing the request (for example it needs more KV blocks than the cache has):
    a 400. After tokens it is a 500.
    """
    if not output.error and not any(c.finish_reason == "error" for c in output.outputs):
        return
    message = output.error or "the engine ended the request with an error"
    if had_tokens or any(c.token_ids for c in output.outputs):
        raise OpenAIError(500, f"the engine failed this request: {message}")
    raise OpenAIError(400, f"the engine refused this request: {message}")


def token_text(tokenizer: TokenizerLike, token_id: int, entry: TokenLogprobs | None) -> str:
    """Gives the text of one token, preferring the engine's decoded form."""
    if entry and token_id in entry and entry[token_id].decoded_token:
        return entry[token_id].decoded_token
    return tokenizer.decode([token_id])


def ranked(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    """Gives the `k` most likely (token id, logprob) pairs of one position."""
    items = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return [(tid, lp.logprob) for tid, lp in items[:k]]


def token_logprobs(completion: CompletionOutput) -> list[tuple[int, TokenLogprobs | None]]:
    """Gives (token id, its logprob entry) for each token of `completion`."""
    entries = completion.logprobs or []
    return [(tid, entries[i] if i < len(entries) else None)
            for i, tid in enumerate(completion.token_ids)]
