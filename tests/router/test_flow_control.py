"""Flow control's shell: requests held while the pool is saturated, let go by band and flow as
room appears, shed with 429 + Retry-After, ended by their time-out or their client leaving;
then the same through the router app in front of a fake engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry
from router_fake_engine import FakeEngine

from kvpilot.engine.router.flow_control import Admission, FlowControl, Shed
from kvpilot.engine.router.flow_metrics import FlowMetrics
from kvpilot.engine.router.flow_queue import QueueLimits
from kvpilot.engine.router.flow_ticket import FlowTicket
from kvpilot.engine.router.saturation import LoadView, SaturationLimits

WAIT = 10.0  # generous: only a broken rule makes a wait this long


class Pool:
    """A one-replica pool whose engine queue a test sets."""

    def __init__(self, waiting: float = 0.0) -> None:
        self.waiting = waiting

    def loads(self) -> list[LoadView]:
        return [LoadView("http://a", waiting=self.waiting)]


def control(pool: Pool, registry: CollectorRegistry | None = None, **limits: float
            ) -> FlowControl:
    return FlowControl(QueueLimits(**limits), SaturationLimits(queue_depth=1),  # type: ignore[arg-type]
                       pool.loads, FlowMetrics(registry or CollectorRegistry()))


def sample(registry: CollectorRegistry, flow: str, priority: int, outcome: str) -> float:
    return registry.get_sample_value("kvpilot_router_flow_requests_total", {
        "flow": flow, "priority": str(priority), "outcome": outcome}) or 0.0


async def until(condition, timeout: float = WAIT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_passes_through_with_room_and_queues_without():
    pool = Pool()
    flow = control(pool)
    assert isinstance(await flow.admit(FlowTicket()), Admission)
    pool.waiting = 1  # saturated
    task = asyncio.create_task(flow.admit(FlowTicket()))
    await until(lambda: len(flow.queue) == 1)
    assert not task.done()
    pool.waiting = 0
    flow.drain()
    admission = await asyncio.wait_for(task, WAIT)
    assert flow.in_transit == 1  # let go, not on a replica yet: it counts against the room
    assert flow.room() == 0
    admission.begun()
    admission.begun()  # idempotent
    assert flow.in_transit == 0 and flow.room() == 1


async def test_dispatch_order_through_the_shell():
    """Room for one at a time: the high band first, then flows in turn, FIFO in a flow."""
    pool = Pool(waiting=1)
    flow = control(pool)
    order: list[str] = []

    async def request(name: str, flow_id: str, priority: int) -> None:
        (await flow.admit(FlowTicket(flow=flow_id, priority=priority))).begun()
        order.append(name)

    tasks = []
    for name, flow_id, priority in [("a1", "A", 0), ("a2", "A", 0), ("a3", "A", 0),
                                    ("b1", "B", 0), ("h1", "H", 7)]:
        tasks.append(asyncio.create_task(request(name, flow_id, priority)))
        queued = len(tasks)
        await until(lambda: len(flow.queue) == queued)  # noqa: B023 (awaited at once)
    pool.waiting = 0
    for n in range(1, 6):
        flow.drain()  # one slot per load change
        await until(lambda n=n: len(order) == n)
    await asyncio.gather(*tasks)
    assert order == ["h1", "a1", "b1", "a2", "a3"]


async def test_time_out_is_a_429_with_retry_after():
    registry = CollectorRegistry()
    flow = control(Pool(waiting=5), registry, queue_timeout_s=0.2)
    runner = asyncio.create_task(flow.run_forever())
    try:
        response = await asyncio.wait_for(flow.gate(FlowTicket(flow="A"), None), WAIT)
    finally:
        runner.cancel()
    assert response.status_code == 429
    assert int(response.headers["retry-after"]) >= 1
    assert b"queue_timeout" in bytes(response.body)
    assert len(flow.queue) == 0 and flow.waiting == {}
    assert sample(registry, "A", 0, "timeout") == 1


async def test_client_disconnect_while_queued_leaves_the_queue():
    registry = CollectorRegistry()
    flow = control(Pool(waiting=5), registry)
    messages: asyncio.Queue[dict[str, str]] = asyncio.Queue()  # ASGI receive, one message
    task = asyncio.create_task(flow.gate(FlowTicket(flow="A"), messages.get))
    await until(lambda: len(flow.queue) == 1)
    messages.put_nowait({"type": "http.disconnect"})
    response = await asyncio.wait_for(task, WAIT)
    assert response.status_code == 499
    assert len(flow.queue) == 0 and flow.waiting == {} and flow.in_transit == 0
    assert sample(registry, "A", 0, "disconnected") == 1


async def test_a_cancelled_handler_leaves_nothing_behind():
    flow = control(Pool(waiting=5))
    task = asyncio.create_task(flow.admit(FlowTicket()))
    await until(lambda: len(flow.queue) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(flow.queue) == 0 and flow.waiting == {} and flow.in_transit == 0


async def test_shedding_starts_at_the_lowest_band():
    registry = CollectorRegistry()
    flow = control(Pool(waiting=5), registry, max_queued=2, max_queued_per_flow=2)
    low = [asyncio.create_task(flow.gate(FlowTicket(flow="L", priority=0), None))
           for _ in range(2)]
    await until(lambda: len(flow.queue) == 2)
    # a third low request finds the queue full and nothing lower: it is shed itself
    shed_low = await asyncio.wait_for(flow.gate(FlowTicket(flow="M", priority=0), None), WAIT)
    assert shed_low.status_code == 429 and "retry-after" in shed_low.headers
    # a high one displaces the newest low one
    high = asyncio.create_task(flow.gate(FlowTicket(flow="H", priority=5), None))
    displaced = await asyncio.wait_for(low[1], WAIT)
    assert displaced.status_code == 429
    assert not low[0].done() and not high.done()
    assert sample(registry, "L", 0, "shed") == 1 and sample(registry, "M", 0, "shed") == 1
    for task in (low[0], high):
        task.cancel()


async def test_an_objective_no_replica_meets_waits_or_is_shed():
    pool = Pool()
    flow = control(pool)
    meets = False
    task = asyncio.create_task(flow.admit(FlowTicket(ttft_slo_s=0.1), meetable=lambda: meets))
    await until(lambda: len(flow.queue) == 1)
    # another flow goes by (inside one flow, first in, first out holds)
    other = await asyncio.wait_for(flow.admit(FlowTicket(flow="B")), WAIT)
    assert isinstance(other, Admission) and not task.done()
    other.begun()
    meets = True
    flow.drain()
    (await asyncio.wait_for(task, WAIT)).begun()
    flow.unmeetable = "shed"
    with pytest.raises(Shed, match="latency objective"):
        await flow.admit(FlowTicket(ttft_slo_s=0.1), meetable=lambda: False)


async def test_router_sheds_a_flood_with_429_and_serves_the_quiet_flow_first(fleet):
    """One replica taking one queued request; flow A floods, flow B sends one request after
    A's: B is dispatched ahead of A's backlog, and A's excess gets 429 + Retry-After."""
    engine = FakeEngine("e1", chunks=2, stream_delay=0.05)
    router, _ = await fleet([engine], flow_control=True, saturation_queue_depth=1,
                            max_queued_per_flow=3, max_queued_requests=8)
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    async with httpx.AsyncClient(timeout=WAIT * 3) as client:
        async def send(flow_id: str) -> httpx.Response:
            headers = {"x-gateway-inference-fairness-id": flow_id}
            return await client.post(f"{router}/v1/completions", json={**body, "user": flow_id},
                                     headers=headers)
        # Wait until the router's scrape has seen the replica, then flood.
        assert (await client.post(f"{router}/v1/completions", json=body)).status_code == 200
        flood = [asyncio.create_task(send("A")) for _ in range(8)]
        await asyncio.sleep(0.05)
        quiet = asyncio.create_task(send("B"))
        responses = await asyncio.gather(*flood, quiet)
        metrics = (await client.get(f"{router}/metrics")).text
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and responses[-1].status_code == 200
    shed = [r for r in responses if r.status_code == 429]
    assert shed and all(int(r.headers["retry-after"]) >= 1 for r in shed)
    served = [b.get("user") for b in engine.bodies[1:]]
    # B went right after at most one of A's queued requests, not behind all of them
    assert served.index("B") <= served.count("A") - 1
    assert served.index("B") < len(served) - 1
    assert 'kvpilot_router_flow_requests_total{flow="A",outcome="shed",priority="0"}' in metrics
