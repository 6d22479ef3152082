"""Forwarding one request to engines: retries before the first byte, a clean error after it.

The response (status, headers) is only sent back to the client once the first
body bytes arrived from an engine, so every failure up to then — refused
connection, timeout, 5xx, 429, a stream that closes empty, an instance found
stalled (`router.stall`) — is retried on another instance. After the first byte a failure cannot be hidden: the client
gets an OpenAI-style SSE error event and the stream ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.engine.contracts.openai_errors import encode_body, error_object
from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER
from kvpilot.engine.router.fleet import Fleet, Instance
from kvpilot.engine.router.metrics import RouterMetrics
from kvpilot.engine.router.stall import Stalled, until_stalled

log = logging.getLogger("kvpilot.router")

# Statuses that say "this instance, not this request": try another.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})



class NoInstance(Exception):
    """Raised when no instance of the wanted role became available in time."""


@dataclass
class Attempt:
    """An upstream response whose first body chunk already arrived."""

    instance: Instance
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes


def sse_error(message: str, status: int) -> bytes:
    """Gives the SSE event that ends a stream cut after its first byte (the engine's shape:
    `code` is the status)."""
    return f"data: {json.dumps(error_object(status, message, code=status))}\n\n".encode()


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """Gives (the SSE events of `data` up to its last blank line, the rest)."""
    end = data.rfind(b"\n\n")
    return (b"", data) if end < 0 else (data[:end + 2], data[end + 2:])


class Forwarder:
    """Sends a body to one instance after another until one answers."""

    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, metrics: RouterMetrics, *,
                 max_retries: int, request_timeout: float) -> None:
        self.fleet, self.client, self.metrics = fleet, client, metrics
        self.max_retries, self.request_timeout = max_retries, request_timeout
        self.on_release: Callable[[], None] = lambda: None  # an instance's load just dropped

    def _begin(self, instance: Instance) -> None:
        instance.expect()
        instance.in_flight += 1
        self.metrics.in_flight.labels(instance.url).set(instance.in_flight)

    def _end(self, instance: Instance, outcome: str, refused: bool = False) -> None:
        instance.in_flight -= 1
        self.metrics.in_flight.labels(instance.url).set(instance.in_flight)
        self.metrics.requests.labels(instance.url, outcome).inc()
        if outcome == "ok":
            self.fleet.succeeded(instance)
        elif outcome == "error":
            self.fleet.failed(instance, "request failed", refused)
        self.on_release()

    async def _try(self, instance: Instance, path: str, body: dict[str, Any],
                   headers: dict[str, str]) -> Attempt | Response:
        """Gives an Attempt, or a final Response to pass through (a 4xx); raises to retry."""
        request = self.client.build_request(
            "POST", instance.url + path, content=encode_body(body),
            headers={"content-type": "application/json", **headers})
        response = await self.client.send(request, stream=True)
        self.fleet.heard(instance)
        if response.status_code in RETRY_STATUSES:
            text = (await response.aread()).decode(errors="replace")[:300]
            await response.aclose()
            raise RetryableStatus(response.status_code, text)
        chunks = response.aiter_raw()
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = b""
        except BaseException:
            await response.aclose()
            raise
        self.fleet.heard(instance)
        if response.status_code >= 400:
            content = first + b"".join([c async for c in chunks])
            await response.aclose()
            return Response(content, response.status_code,
                            media_type=response.headers.get("content-type"))
        return Attempt(instance, response, chunks, first)

    async def send(self, pick: Callable[[set[str]], Awaitable[Instance]], path: str,
                   body: dict[str, Any], headers: dict[str, str],
                   served_by: str = "") -> Response:
        """Gives the client's response, trying up to 1 + max_retries instances picked by `pick`."""
        arrival = time.monotonic()
        tried: set[str] = set()
        last_error, all_busy = "no instance tried", True
        for attempt_no in range(self.max_retries + 1):
            try:
                instance = await pick(tried)
            except NoInstance as exc:
                if tried:  # every ready instance failed already
                    break
                return JSONResponse(error_object(503, str(exc), code="no_instance"), 503)
            tried.add(instance.url)
            self._begin(instance)
            try:
                # nothing has reached the client yet: a stalled instance's attempt moves on
                result = await asyncio.wait_for(
                    until_stalled(instance.stall, self._try(instance, path, body, headers)),
                    self.request_timeout)
            except (httpx.HTTPError, RetryableStatus, TimeoutError, OSError, Stalled) as exc:
                busy = isinstance(exc, RetryableStatus) and exc.status == 429
                all_busy = all_busy and busy
                outcome = "busy" if busy else "stalled" if isinstance(exc, Stalled) else "error"
                self._end(instance, outcome, refused=isinstance(exc, httpx.ConnectError))
                last_error = f"{instance.url}: {exc!r}"
                log.info("attempt %d on %s failed: %r", attempt_no + 1, instance.url, exc)
                if attempt_no < self.max_retries:
                    self.metrics.retries.labels(instance.url).inc()
                continue
            served = ",".join(filter(None, [served_by, instance.url]))
            if isinstance(result, Response):
                self._end(instance, "client_error")
                result.headers[SERVED_BY_HEADER] = served
                return result
            self.metrics.ttfb.observe(time.monotonic() - arrival)
            return self._respond(result, arrival, served)
        if all_busy:  # overloaded, not broken: the client should back off and retry
            return JSONResponse(error_object(429, f"every instance is busy; last: {last_error}",
                                             code="every_instance_busy"), 429)
        return JSONResponse(error_object(502, f"all attempts failed; last: {last_error}",
                                         code="upstream_error"), 502)

    def _respond(self, attempt: Attempt, arrival: float, served: str) -> Response:
        content_type = attempt.response.headers.get("content-type", "application/json")
        sse = content_type.startswith("text/event-stream")
        return StreamingResponse(self._relay(attempt, arrival, sse), attempt.response.status_code,
                                 {SERVED_BY_HEADER: served}, media_type=content_type)

    async def _relay(self, attempt: Attempt, arrival: float, sse: bool) -> AsyncIterator[bytes]:
        """Yields the upstream bytes; a failure after the first byte ends in an error event.

        An event stream goes out whole events at a time (up to its last blank line), so an
        upstream that dies mid-event leaves no torn event before the error event."""
        outcome = "cancelled"  # unless it ends or breaks: the client went away
        deadline = arrival + self.request_timeout
        held = b""  # an event stream's bytes after its last complete event
        try:
            chunk = attempt.first
            while True:
                if sse:
                    chunk, held = whole_events(held + chunk)
                if chunk:
                    yield chunk
                try:
                    # read in this task, not in a wait_for task: a client that goes away
                    # cancelled that task inside httpx's read, whose clean-up then left the
                    # connection ACTIVE in the pool with its socket open, one per dropped
                    # request (CLOSE_WAIT sockets by the hundred: bench/soak.py)
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                        chunk = await anext(attempt.chunks)
                except StopAsyncIteration:
                    break
                self.fleet.heard(attempt.instance)
            if held:
                yield held  # the stream ended without a last blank line: as it came
            outcome = "ok"
        except TimeoutError:
            # The request outlived request_timeout: the client's budget, not the instance's fault.
            outcome = "timeout"
            if sse:
                yield sse_error(f"request_timeout={self.request_timeout}s exceeded", 504)
        except (httpx.HTTPError, OSError) as exc:
            outcome = "error"
            log.warning("stream from %s broke after the first byte: %r", attempt.instance.url,
                        exc)
            if sse:
                yield sse_error(f"upstream {attempt.instance.url} failed mid-stream: {exc!r}", 502)
        finally:
            await attempt.response.aclose()
            self._end(attempt.instance, outcome)


class RetryableStatus(Exception):
    """An instance answered with a status that another instance may not give."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
