"""Flow control's async shell: holds requests in the `FlowQueue` while the pool is saturated.

A request passes straight through when nothing is queued and the pool has headroom
(`saturation.pool_headroom`, less the requests already dispatched but not yet on a
replica) that its flow may take (`flow_share`: the last free slots are kept for flows
under their fair share). Otherwise it is queued and waits until `drain` dispatches it
(whenever a request ends, a scrape lands, or the tick runs), its queue time-out passes,
it is shed to make room, or its client goes away. A shed or timed-out request gets a
429 with `Retry-After`: how long the queue ahead of it takes at the recent dispatch rate.

A request let through carries its engine priority (`flow_share.engine_priority`: its band,
quiet flows first), which the router sends to the engine as the body's `priority`: under
the engines' `--scheduling-policy priority` the request that flow control would let go
first also leaves the engine's waiting queue first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.responses import AsyncContentStream, Content

from kvpilot.engine.contracts.openai_errors import error_object
from kvpilot.engine.router.flow_metrics import FlowMetrics
from kvpilot.engine.router.flow_queue import FlowQueue, QueueLimits, Waiter, retry_after_s
from kvpilot.engine.router.flow_share import FlowKey, FlowUsage, engine_priority
from kvpilot.engine.router.flow_ticket import FlowTicket
from kvpilot.engine.router.saturation import LoadView, SaturationLimits, pool_headroom, slots

TICK_S = 0.1  # the backstop: time-outs and missed wake-ups are seen within this
RATE_WINDOW_S = 10.0  # dispatches counted for Retry-After
UNMEETABLE = ("queue", "shed")
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the logs do


@dataclass(frozen=True)
class ClientSide:
    """What the router has of the client beyond the body: its headers, and an awaitable
    that returns once the client disconnects (ASGI `receive` after the body)."""

    headers: Mapping[str, str]
    disconnected: Callable[[], Awaitable[Any]] | None = None


class Shed(Exception):
    """A request flow control turns away (429 with Retry-After)."""

    def __init__(self, outcome: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.outcome, self.retry_after = outcome, retry_after

    def response(self) -> Response:
        return JSONResponse(error_object(429, str(self)), 429,
                            headers={"retry-after": str(self.retry_after)})


class Queued(NamedTuple):
    """A queued request's ticket, the future its handler awaits, and its objective check."""

    ticket: FlowTicket
    future: asyncio.Future[None]
    meetable: Callable[[], bool]


class ClientGone(Exception):
    """The client disconnected while its request was queued."""


class Admission:
    """A request flow control let through: `begun` once a replica took it, `ended` once its
    response is over (each idempotent); `watch` ends it with its response's body.
    `engine_priority`: the body's `priority` for the engine (None: the client's stands)."""

    def __init__(self, control: FlowControl | None = None, flow: FlowKey = ("", 0),
                 in_transit: bool = False, engine_priority: int | None = None) -> None:
        self._control, self._flow, self._in_transit = control, flow, in_transit
        self.engine_priority = engine_priority

    @property
    def key(self) -> FlowKey:
        return self._flow

    def begun(self) -> None:
        if self._in_transit and self._control is not None:
            self._control.in_transit -= 1
        self._in_transit = False

    def ended(self) -> None:
        self.begun()
        if self._control is not None:
            control, self._control = self._control, None
            control.flow_ended(self._flow)

    def watch(self, response: Response) -> Response:
        """Gives `response`, ending the admission once its body has gone (now, unless it
        streams)."""
        self.begun()
        if self._control is None:
            return response
        if not isinstance(response, StreamingResponse):
            self.ended()
            return response
        response.body_iterator = self._until_end(response.body_iterator)
        return response

    async def _until_end(self, chunks: AsyncContentStream) -> AsyncIterator[Content]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.ended()
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()


async def _until_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    while True:
        message = await receive()
        if not isinstance(message, dict) or message.get("type") == "http.disconnect":
            return


class FlowControl:
    """The router's flow queue and the rule for when it dispatches."""

    def __init__(self, queue_limits: QueueLimits, saturation: SaturationLimits,
                 loads: Callable[[], list[LoadView]], metrics: FlowMetrics, *,
                 unmeetable: str = "queue", reserved_slots_fraction: float = 0.0) -> None:
        if unmeetable not in UNMEETABLE:
            raise ValueError(f"slo_unmeetable={unmeetable!r} is invalid: choose queue or shed")
        if not 0 <= reserved_slots_fraction < 1:
            raise ValueError(f"reserved_slots_fraction={reserved_slots_fraction!r} is invalid: "
                             "must be in [0, 1) (0: no slot kept for flows under their share)")
        self.queue = FlowQueue(queue_limits)
        self.saturation, self.loads, self.metrics = saturation, loads, metrics
        self.unmeetable, self.reserved_slots_fraction = unmeetable, reserved_slots_fraction
        self.usage = FlowUsage()
        self.waiting: dict[Waiter, Queued] = {}
        self.in_transit = 0  # dispatched, not on a replica yet
        self.dispatched: deque[float] = deque()  # recent dispatch times

    def room(self) -> int | None:
        """Gives how many more requests may go to replicas now; None: no replica is ready."""
        headroom = pool_headroom(self.loads(), self.saturation)
        return None if headroom is None else headroom - self.in_transit

    def taker(self, now: float) -> Callable[[FlowKey, int | None], bool]:
        """Gives the rule, as of `now`, for whether a flow's request may take one of `room`
        free slots (`flow_share`); with no replica ready any may go (to wait for one)."""
        rule = self.usage.taker(now, self.queue.flows(), slots(self.loads()),
                                self.reserved_slots_fraction)
        return lambda key, room: room is None or rule(key, room)

    def engine_priority(self, key: FlowKey) -> int:
        """Gives the engine priority of a request of flow `key` let through now."""
        quiet = self.usage.quiet(time.monotonic(), self.queue.flows())
        return engine_priority(key, quiet(key))

    def flow_ended(self, key: FlowKey) -> None:
        """Notes that a request of flow `key` ended (its slot is free) and lets others go."""
        self.usage.ended(key)
        self.drain()

    async def gate(self, ticket: FlowTicket, disconnected: Callable[[], Awaitable[Any]] | None,
                   meetable: Callable[[], bool] = lambda: True) -> Admission | Response:
        """Gives the request's Admission once it may go to a replica, or the response that
        ends it here (429 shed or timed out; 499 when its client left while queued)."""
        try:
            return await self.admit(ticket, disconnected, meetable)
        except Shed as exc:
            return exc.response()
        except ClientGone:
            return JSONResponse(error_object(CLIENT_GONE, "the client disconnected while queued"),
                                CLIENT_GONE)

    async def admit(self, ticket: FlowTicket,
                    disconnected: Callable[[], Awaitable[Any]] | None = None,
                    meetable: Callable[[], bool] = lambda: True) -> Admission:
        """Returns once the request may go to a replica; raises Shed or ClientGone.

        `meetable` says whether some replica is predicted to meet the request's latency
        objectives now; while it says no, the request waits (`--slo-unmeetable queue`) or
        is shed at once (`shed`)."""
        now = time.monotonic()
        self.usage.arrived(ticket.key, now)
        meets = meetable()
        if not meets and self.unmeetable == "shed":
            self.metrics.outcome(ticket.flow, ticket.priority, "unmeetable", None)
            raise Shed("unmeetable", f"no replica is predicted to meet this request's latency "
                       f"objective (ttft {ticket.ttft_slo_s}s, tpot {ticket.tpot_slo_s}s)",
                       self._retry_after(len(self.queue)))
        room = self.room()
        if not self.queue and meets and self.taker(now)(ticket.key, room):
            self._dispatched(ticket, now, now)
            return Admission(self, ticket.key, engine_priority=self.engine_priority(ticket.key))
        waiter = Waiter(ticket.flow, ticket.priority, now)
        for shed in self.queue.offer(waiter):
            self._shed(shed, ticket if shed is waiter else None)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[waiter] = Queued(ticket, future, meetable)
        self.metrics.queue_changed(ticket.flow, ticket.priority, 1)
        self.drain()
        return await self._wait(waiter, future, disconnected)

    async def _wait(self, waiter: Waiter, future: asyncio.Future[None],
                    disconnected: Callable[[], Awaitable[Any]] | None) -> Admission:
        gone = asyncio.ensure_future(_until_disconnect(disconnected)) if disconnected else None
        try:
            await asyncio.wait([f for f in (future, gone) if f is not None],
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the handler was cancelled (shutdown): leave nothing behind
            self._leave(waiter, future)
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if future.done():
            future.result()  # raises Shed
            return Admission(self, waiter.key, in_transit=True,
                             engine_priority=self.engine_priority(waiter.key))
        self._leave(waiter, future)
        raise ClientGone

    def _leave(self, waiter: Waiter, future: asyncio.Future[None]) -> None:
        """Takes a request out that stops waiting: still queued, or already dispatched."""
        if self.queue.remove(waiter):
            ticket = self.waiting.pop(waiter).ticket
            self.metrics.queue_changed(ticket.flow, ticket.priority, -1)
            self.metrics.outcome(ticket.flow, ticket.priority, "disconnected", None)
        elif future.done() and not future.cancelled() and future.exception() is None:
            Admission(self, waiter.key, in_transit=True).ended()  # it never reaches a replica
        future.cancel()

    def drain(self) -> None:
        """Dispatches queued requests while the pool has room (call when load changes)."""
        room = self.room()
        if not self.queue or (room is not None and room <= 0):
            return
        now = time.monotonic()
        may_take = self.taker(now)
        while self.queue and (room is None or room > 0):
            waiter = self.queue.pop(lambda w: may_take(w.key, room)  # noqa: B023 (used now)
                                    and self.waiting[w].meetable())
            if waiter is None:
                return
            ticket, future, _ = self.waiting.pop(waiter)
            self.metrics.queue_changed(ticket.flow, ticket.priority, -1)
            self._dispatched(ticket, waiter.arrival, now)
            self.in_transit += 1
            future.set_result(None)
            if room is not None:
                room -= 1

    def expire(self) -> None:
        """Ends the queued requests whose queue time-out passed."""
        for waiter in self.queue.expire(time.monotonic()):
            self._shed(waiter, None, "timeout")

    async def run_forever(self) -> None:
        """Expires time-outs and drains every TICK_S (a backstop for missed wake-ups)."""
        while True:
            await asyncio.sleep(TICK_S)
            self.expire()
            self.drain()

    def _dispatched(self, ticket: FlowTicket, arrival: float, now: float) -> None:
        self.usage.dispatched(ticket.key)
        self.dispatched.append(now)
        while self.dispatched and self.dispatched[0] < now - RATE_WINDOW_S:
            self.dispatched.popleft()
        self.metrics.outcome(ticket.flow, ticket.priority, "dispatched", now - arrival)

    def _retry_after(self, ahead: int) -> int:
        window = min(RATE_WINDOW_S, max(time.monotonic() - self.dispatched[0], 1.0)) \
            if self.dispatched else RATE_WINDOW_S
        return retry_after_s(ahead, len(self.dispatched) / window)

    def _shed(self, waiter: Waiter, arriving: FlowTicket | None, outcome: str = "shed") -> None:
        """Ends `waiter` with a 429: raised at once when it is the `arriving` request."""
        limits = self.queue.limits
        if outcome == "timeout":
            message = (f"queued {limits.queue_timeout_s:g}s (queue_timeout) while every replica "
                       "stayed saturated")
        else:
            message = (f"every replica is saturated and the flow queue is full for flow "
                       f"{waiter.flow!r} in priority band {waiter.priority} "
                       f"(max_queued_per_flow={limits.max_queued_per_flow}, "
                       f"max_queued={limits.max_queued}; lower bands are shed first)")
        error = Shed(outcome, message, self._retry_after(len(self.queue)))
        self.metrics.outcome(waiter.flow, waiter.priority, outcome, None)
        if arriving is not None:
            raise error
        ticket, future, _ = self.waiting.pop(waiter)
        self.metrics.queue_changed(ticket.flow, ticket.priority, -1)
        future.set_exception(error)
