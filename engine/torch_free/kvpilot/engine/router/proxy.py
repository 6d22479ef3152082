"""Forwarding one request to engines: retries before the first byte, migration after it.

The response (status, headers) is only sent back to the client once the first
body bytes arrived from an engine, so every failure up to then — refused
connection, timeout, 5xx, 429, a stream that closes empty, an instance found
stalled (`router.stall`) — is retried on another instance, holding for one to come back
when every ready one failed it (`router.tries`). After the first byte a stream that can
move goes on on another instance (`router.migration`); any other failure ends it with an
OpenAI-style SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpilot.engine.contracts.openai_errors import encode_body, error_object
from kvpilot.engine.contracts.router_args import RESUMABLE_HEADER, SERVED_BY_HEADER
from kvpilot.engine.router.fleet import Fleet, Instance
from kvpilot.engine.router.metrics import RouterMetrics
from kvpilot.engine.router.migration import (
    Interruption,
    StreamRecord,
    error_event,
    not_resumable,
)
from kvpilot.engine.router.stall import Stalled, until_stalled
from kvpilot.engine.router.tries import Tries

log = logging.getLogger("kvpilot.router")

# Statuses that say "this instance, not this request": try another.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# seconds between looks for an instance that came back while a request holds: answering a
# health check moves its `last_heard` but sets no event
HOLD_POLL = 0.2

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


@dataclass
class Mover:
    """A stream's way to another replica: what to resend, where to pick, what the client has."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    pick: Callable[[set[str]], Awaitable[Instance]]
    blocked: str | None  # why it cannot move (`migration.not_resumable`), None when it can
    on_migrate: Callable[[], None]  # told when a continuation took over
    record: StreamRecord = field(default_factory=StreamRecord)
    migrations: int = 0


@dataclass
class _Leg:
    """One replica's part of a stream, and how it ended."""

    attempt: Attempt
    interruption: Interruption | None = None


class Forwarder:
    """Sends a body to one instance after another until one answers; moves a stream that
    breaks mid-way to another instance (`router.migration`)."""

    def __init__(self, fleet: Fleet, client: httpx.AsyncClient, metrics: RouterMetrics, *,
                 max_retries: int, request_timeout: float, max_migrations: int = 0,
                 hold_timeout: float = 30.0) -> None:
        self.fleet, self.client, self.metrics = fleet, client, metrics
        self.max_retries, self.request_timeout = max_retries, request_timeout
        self.max_migrations, self.hold_timeout = max_migrations, hold_timeout
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

    async def _attempt(self, instance: Instance, path: str, body: dict[str, Any],
                       headers: dict[str, str], deadline: float) -> Attempt | Response:
        """Gives `_try`'s result within the deadline; raises Stalled when `instance` is found
        stalled before it answered (nothing has reached the client from it yet)."""
        return await asyncio.wait_for(
            until_stalled(instance.stall, self._try(instance, path, body, headers)),
            max(deadline - time.monotonic(), 0.0))

    async def send(self, pick: Callable[[set[str]], Awaitable[Instance]], path: str,
                   body: dict[str, Any], headers: dict[str, str], served_by: str = "",
                   resume_pick: Callable[[set[str]], Awaitable[Instance]] | None = None,
                   on_migrate: Callable[[], None] = lambda: None,
                   unmovable: str | None = None) -> Response:
        """Gives the client's response from an instance `pick` gives, tried as
        `router.tries` says (up to 1 + 2 x max_retries times, holding up to hold_timeout).

        A stream that breaks after its first byte moves to an instance `resume_pick` (else
        `pick`) gives, at most max_migrations times, unless `unmovable` says why it may not;
        `on_migrate` is told each time."""
        arrival = time.monotonic()
        mover = None
        if body.get("stream") is True:
            blocked = unmovable or not_resumable(path, body, self.max_migrations)
            if blocked is None:
                headers = {**headers, RESUMABLE_HEADER: "1"}
            mover = Mover(path, body, headers, resume_pick or pick, blocked, on_migrate)
        tries = Tries(self.max_retries, self.hold_timeout, arrival + self.request_timeout)
        placed = await self._place(pick, path, body, headers, tries)
        if placed is None:
            if tries.made == 0:
                return JSONResponse(error_object(503, tries.last_error, code="no_instance"), 503)
            if tries.answer_busy:  # overloaded, not broken: the client should back off and retry
                return JSONResponse(error_object(
                    429, f"every instance is busy; last: {tries.last_error}",
                    code="every_instance_busy"), 429)
            return JSONResponse(error_object(502, tries.why(), code="upstream_error"), 502)
        instance, result = placed
        served = ",".join(filter(None, [served_by, instance.url]))
        if isinstance(result, Response):
            result.headers[SERVED_BY_HEADER] = served
            return result
        self.metrics.ttfb.observe(time.monotonic() - arrival)
        return self._respond(result, arrival, served, mover)

    async def _place(self, pick: Callable[[set[str]], Awaitable[Instance]], path: str,
                     body: dict[str, Any], headers: dict[str, str], tries: Tries
                     ) -> tuple[Instance, Attempt | Response] | None:
        """Gives the instance that answered and its attempt (or the 4xx it refused the
        request with); None when `tries` ran out (`router.tries`: `tries.why()`), or when no
        instance was ready within `pick`'s hold before any try (`tries.last_error`)."""
        previous = ""
        while True:
            if tries.made >= tries.budget and (tries.answer_busy or not tries.hold()):
                return None
            exclude = tries.excluded(self.fleet.instances)
            try:
                if tries.hold_until is None:  # nothing failed yet: `pick` holds on its own
                    instance = await pick(exclude)
                else:
                    async with asyncio.timeout(tries.left(time.monotonic())):
                        instance = await pick(exclude)
            except NoInstance as exc:
                if not exclude:  # none was ready within the hold time
                    tries.last_error = str(exc)
                    return None
                # every ready instance failed it: wait for one to come back, or a new one
                left = tries.left(time.monotonic())
                if tries.answer_busy or not tries.hold() or left <= 0:
                    return None
                await self._fleet_change(time.monotonic() + min(HOLD_POLL, left))
                continue
            except TimeoutError:  # the hold time ran out while `pick` waited
                return None
            if previous:
                self.metrics.retries.labels(previous).inc()
            tries.started()
            self._begin(instance)
            try:
                # nothing has reached the client yet: a stalled instance's attempt moves on
                result = await self._attempt(instance, path, body, headers, tries.deadline)
            except (httpx.HTTPError, RetryableStatus, TimeoutError, OSError, Stalled) as exc:
                busy = isinstance(exc, RetryableStatus) and exc.status == 429
                outcome = "busy" if busy else "stalled" if isinstance(exc, Stalled) else "error"
                self._end(instance, outcome, refused=isinstance(exc, httpx.ConnectError))
                tries.failed(instance.url, repr(exc), busy)
                log.info("attempt %d on %s failed: %r", tries.made, instance.url, exc)
                previous = instance.url
                continue
            if isinstance(result, Response):
                self._end(instance, "client_error")
            return instance, result

    def _respond(self, attempt: Attempt, arrival: float, served: str,
                 mover: Mover | None) -> Response:
        content_type = attempt.response.headers.get("content-type", "application/json")
        sse = content_type.startswith("text/event-stream")
        return StreamingResponse(self._relay(attempt, arrival, sse, mover if sse else None),
                                 attempt.response.status_code, {SERVED_BY_HEADER: served},
                                 media_type=content_type)

    async def _relay(self, attempt: Attempt, arrival: float, sse: bool,
                     mover: Mover | None) -> AsyncIterator[bytes]:
        """Yields the upstream bytes, moving a resumable stream that breaks to another
        instance; a failure it cannot move past ends in an error event."""
        deadline = arrival + self.request_timeout
        record = mover.record if mover is not None and mover.blocked is None else None
        while True:
            leg = _Leg(attempt)
            part = self._leg(leg, deadline, sse, record, mover.blocked if mover else None)
            try:
                async for data in part:
                    yield data
            finally:
                await part.aclose()
            if leg.interruption is None or mover is None:
                return
            moved = await self._migrate(mover, leg.interruption, deadline,
                                        attempt.instance.url)
            if isinstance(moved, bytes):
                yield moved
                return
            attempt = moved

    async def _leg(self, leg: _Leg, deadline: float, sse: bool, record: StreamRecord | None,
                   blocked: str | None) -> AsyncGenerator[bytes, None]:
        """Yields one attempt's bytes; a resumable stream (`record`) that breaks sets
        `leg.interruption` instead of ending in an error event.

        An event stream goes out whole events at a time (up to its last blank line), so an
        upstream that dies mid-event leaves no torn event before the error event."""
        attempt = leg.attempt
        url = attempt.instance.url
        outcome = "cancelled"  # unless it ends or breaks: the client went away
        held = b""  # an event stream's bytes after its last complete event
        # a resumable stream also moves when its instance is found stalled
        stall = asyncio.ensure_future(attempt.instance.stall.wait()) if record else None
        try:
            chunk = attempt.first
            while True:
                if sse:
                    chunk, held = whole_events(held + chunk)
                if record is not None and chunk:
                    chunk, leg.interruption = record.take(chunk)
                if chunk:
                    yield chunk
                if leg.interruption is not None:
                    break
                try:
                    chunk = await self._next(attempt.chunks, deadline, stall)
                except StopAsyncIteration:
                    break
                self.fleet.heard(attempt.instance)
            if leg.interruption is not None:
                outcome = "handed_over" if leg.interruption.reason == "drained" else "error"
            elif record is not None and not record.done:
                outcome = "error"
                leg.interruption = Interruption("upstream_failed", f"upstream {url} ended the "
                                                "stream before data: [DONE]")
            else:
                if held:
                    yield held  # the stream ended without a last blank line: as it came
                outcome = "ok"
        except TimeoutError:
            # The request outlived request_timeout: the client's budget, not the instance's fault.
            outcome = "timeout"
            if sse:
                yield sse_error(f"request_timeout={self.request_timeout}s exceeded", 504)
        except Stalled:
            outcome = "stalled"
            leg.interruption = Interruption("stalled", f"upstream {url} stalled mid-stream")
        except (httpx.HTTPError, OSError) as exc:
            outcome = "error"
            message = f"upstream {url} failed mid-stream: {exc!r}"
            if record is not None:
                leg.interruption = Interruption("upstream_failed", message)
            else:
                log.warning("stream from %s broke after the first byte: %r", url, exc)
                if sse:
                    why = f" (not resumed: {blocked})" if blocked else ""
                    yield sse_error(message + why, 502)
        finally:
            if stall is not None:
                stall.cancel()
            await attempt.response.aclose()
            self._end(attempt.instance, outcome)

    @staticmethod
    async def _next(chunks: AsyncIterator[bytes], deadline: float,
                    stall: asyncio.Future[Any] | None) -> bytes:
        """Gives the next upstream chunk; raises TimeoutError past `deadline` and Stalled once
        `stall` is done (the instance was found stalled)."""
        # read in this task, not in a wait_for or racing task: a client that goes away
        # cancelled that task inside httpx's read, whose clean-up then left the connection
        # ACTIVE in the pool with its socket open, one per dropped request (CLOSE_WAIT
        # sockets by the hundred: bench/soak.py); a stall ends the read by moving the
        # timeout's deadline to now
        loop, reading = asyncio.get_running_loop(), True

        def stalled(_: asyncio.Future[Any]) -> None:
            if reading:
                scope.reschedule(loop.time())

        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)) as scope:
                if stall is not None:
                    stall.add_done_callback(stalled)
                return await anext(chunks)
        except TimeoutError:
            if stall is not None and stall.done():
                raise Stalled("the instance stalled mid-stream") from None
            raise
        finally:
            reading = False
            if stall is not None:
                stall.remove_done_callback(stalled)

    async def _migrate(self, mover: Mover, why: Interruption, deadline: float, left: str
                       ) -> Attempt | bytes:
        """Gives the attempt that continues the stream on an instance other than `left`, or
        the events that end it when it cannot go on (saying why)."""
        reason = why.reason
        if mover.migrations >= self.max_migrations:
            return self._unmoved(why, f"it moved --max-migrations={self.max_migrations} "
                                 "times already")
        mover.migrations += 1
        body, headers = mover.record.continuation(mover.body, mover.headers)
        # every ready instance may have failed it: it holds for one to come back (a
        # restart, a stalled one answering again) rather than end the stream
        tries = Tries(self.max_retries, self.hold_timeout, deadline, never=frozenset({left}),
                      busy_holds=True)
        tries.start_hold_time(why.at)
        placed = await self._place(mover.pick, mover.path, body, headers, tries)
        if placed is None:
            return self._unmoved(why, f"no other instance took it: {tries.why()}")
        instance, result = placed
        if isinstance(result, Response):  # it refused the continuation
            return self._unmoved(why, f"{instance.url} refused the continuation: "
                                 f"{bytes(result.body)[:300].decode(errors='replace')}")
        took = time.monotonic() - why.at
        self.metrics.migrations.labels(reason, "resumed").inc()
        self.metrics.migration_seconds.observe(took)
        log.info("stream %s moved to %s after %d tokens in %.3fs (%s: %s)",
                 mover.record.response_id, instance.url, len(mover.record.token_ids), took,
                 reason, why.message)
        mover.on_migrate()
        return result

    async def _fleet_change(self, until: float) -> None:
        """Returns once an instance appeared or came back from ejection or a stall, or at
        `until`."""
        self.fleet.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.fleet.changed.wait(), max(until - time.monotonic(), 0))

    def _unmoved(self, why: Interruption, because: str) -> bytes:
        """Gives the events ending a stream that broke and could not move (counted)."""
        self.metrics.migrations.labels(why.reason, "failed").inc()
        log.warning("stream not resumed: %s; %s", why.message, because)
        return error_event(why.status, f"{why.message} (not resumed: {because})")


class GuardedTransport(httpx.AsyncBaseTransport):
    """The router's transport to its engines: a fault inside the HTTP stack that is neither
    an HTTP nor an OS error (anyio raised AttributeError on a socket its peer closed as it
    connected: the chaos test saw it as a 500 and a lost request) becomes
    httpx.TransportError, which every caller already takes for a failed send (retried on
    another instance, a failed probe)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._inner.handle_async_request(request)
        except (httpx.HTTPError, OSError):
            raise
        except Exception as exc:
            raise httpx.TransportError(f"fault in the HTTP stack: {exc!r}",
                                       request=request) from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


class RetryableStatus(Exception):
    """An instance answered with a status that another instance may not give."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
