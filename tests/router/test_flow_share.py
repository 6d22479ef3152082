"""The reserve of free slots for quiet flows (`flow_share`), the slot rule of saturation, and
both through flow control's shell and the router: a flood never holds the slots a quiet
flow's next request needs, and a request's slot is the flow's until its response ends."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client import CollectorRegistry
from router_fake_engine import FakeEngine

from kvpilot.engine.router.flow_control import Admission, FlowControl
from kvpilot.engine.router.flow_metrics import FlowMetrics
from kvpilot.engine.router.flow_queue import QueueLimits
from kvpilot.engine.router.flow_share import (
    RATE_FLOOR_S,
    WINDOW_S,
    FlowUsage,
    engine_priority,
    reserve_of,
)
from kvpilot.engine.router.flow_ticket import FlowTicket
from kvpilot.engine.router.saturation import (
    LoadView,
    SaturationLimits,
    headroom,
    occupied,
    scraped_slots,
    slots,
)

WAIT = 10.0


def usage_of(arrivals: dict[tuple[str, int], int], in_flight: dict[tuple[str, int], int],
             now: float = 100.0) -> FlowUsage:
    usage = FlowUsage()
    for key, n in arrivals.items():
        for _ in range(n):
            usage.arrived(key, now)
    for key, n in in_flight.items():
        for _ in range(n):
            usage.dispatched(key)
    return usage


A, B = ("A", 0), ("B", 0)
HIGH, LOW = ("h", 10), ("l", 0)


@pytest.mark.parametrize(("arrivals", "in_flight", "key", "room", "allowed"), [
    # more free slots than the reserve: anyone
    ({A: 30, B: 2}, {A: 5}, A, 3, True),
    # the last 2 (reserve of 8 slots at 0.25): not for the flood...
    ({A: 30, B: 2}, {A: 6}, A, 2, False),
    ({A: 30, B: 2}, {A: 6}, A, 1, False),
    # ... but for the quiet flow, however many it has in flight
    ({A: 30, B: 2}, {A: 6}, B, 2, True),
    ({A: 30, B: 2}, {A: 4, B: 3}, B, 1, True),
    # a flow alone is under its share (the whole pool): the reserve costs it nothing
    ({A: 30}, {A: 7}, A, 1, True),
    # two equal floods: each is quiet only while it sent fewer than the other
    ({A: 10, B: 10}, {}, A, 1, False),
    ({A: 9, B: 10}, {}, A, 1, True),
    # a lower band never takes the reserve while a higher one is active, quiet or not
    ({HIGH: 30, LOW: 1}, {HIGH: 6}, LOW, 2, False),
    ({HIGH: 30, LOW: 1}, {HIGH: 6}, HIGH, 2, True),
    ({HIGH: 1, LOW: 30}, {LOW: 6}, LOW, 2, False),
    # no free slot: nobody
    ({A: 1, B: 30}, {B: 8}, A, 0, False),
])
def test_who_may_take_the_reserve(arrivals, in_flight, key, room, allowed):
    usage = usage_of(arrivals, in_flight)
    assert usage.taker(100.0, set(), 8, 0.25)(key, room) is allowed


def test_a_flood_that_just_began_is_a_flood_at_once():
    # B sent 3/s for the whole window; A's flood began 20 ms ago with its second request
    usage = FlowUsage()
    for n in range(30):
        usage.arrived(B, 100.0 - WINDOW_S + 0.05 + n / 3)
    usage.arrived(A, 99.98)
    usage.arrived(A, 100.0)
    usage.dispatched(A)
    may_take = usage.taker(100.0, set(), 8, 0.25)
    assert usage.rate(A) == pytest.approx(2 / RATE_FLOOR_S)
    assert usage.rate(B) == pytest.approx(3.0, rel=0.05)
    # the reserve stays B's: A's two requests outweigh B's 30 (a count over the window
    # would have called A the quiet one and given it B's slots for the flood's first second)
    assert not may_take(A, 2)
    assert may_take(B, 2)
    assert may_take(A, 3)  # above the reserve: anyone


def test_a_flow_that_stopped_keeps_its_rate_until_it_leaves_the_window():
    # the probe sent 15/s from 85 s to 92 s; B sends 4/s; at 100 s, 3 of 8 slots are held
    usage = FlowUsage()
    probe = ("probe", 0)
    for n in range(105):
        usage.arrived(probe, 85.0 + n / 15)
    for n in range(40):
        usage.arrived(B, 90.2 + n / 4)
    may_take = usage.taker(100.0, set(), 8, 0.625)
    assert usage.rate(probe) == pytest.approx(15.0, rel=0.05)
    # B stays the quiet one: the reserve is still B's (the probe's 30 arrivals left in the
    # window over the 10 s up to now, 3/s, made B the heavier flow and its 4th request wait)
    assert may_take(B, 5)


def test_a_flow_silent_for_the_window_stops_counting():
    usage = usage_of({A: 30, B: 1}, {A: 6})
    assert not usage.taker(100.0, set(), 8, 0.25)(A, 2)
    assert not usage.taker(100.0 + WINDOW_S - 1, set(), 8, 0.25)(A, 2)
    assert usage.taker(100.0 + WINDOW_S + 1, set(), 8, 0.25)(A, 2)  # B is gone: A alone
    # ... unless it has a request queued or in flight
    assert not usage.taker(100.0 + WINDOW_S + 1, {B}, 8, 0.25)(A, 2)
    usage.dispatched(B)
    assert not usage.taker(100.0 + WINDOW_S + 1, set(), 8, 0.25)(A, 2)
    usage.ended(B)
    assert usage.in_flight == {A: 6}


@pytest.mark.parametrize(("pool", "fraction", "reserve"), [
    (8, 0.0, 0), (8, 0.125, 1), (8, 0.2, 2), (8, 0.5, 4), (256, 0.125, 32), (0, 0.5, 0)])
def test_reserve_of(pool, fraction, reserve):
    assert reserve_of(pool, fraction) == reserve


@pytest.mark.parametrize(("view", "room"), [
    # slots known: what the scrape saw running and waiting, plus the router's sends since
    (LoadView("a", running=5, in_flight=5, in_flight_at_scrape=5, max_num_seqs=8), 3),
    (LoadView("a", running=5, in_flight=7, in_flight_at_scrape=5, max_num_seqs=8), 1),
    (LoadView("a", running=8, in_flight=6, in_flight_at_scrape=8, max_num_seqs=8), 2),
    # another router's requests count too (scraped beyond what this one has open)...
    (LoadView("a", running=8, in_flight=2, in_flight_at_scrape=2, max_num_seqs=8), 0),
    # ... and never fewer than this router has open (sent before the scrape saw them)
    (LoadView("a", running=1, in_flight=6, in_flight_at_scrape=6, max_num_seqs=8), 2),
    # a KV-bound engine queues with slots free: those wait count as taken
    (LoadView("a", running=4, waiting=3, in_flight=7, in_flight_at_scrape=7, max_num_seqs=8),
     1),
    (LoadView("a", running=2, in_flight=2, in_flight_at_scrape=2, max_num_seqs=8,
              kv_usage=0.97), 0),
    # slots unknown: the queue-depth rule (depth 2)
    (LoadView("a", running=8, in_flight=8, in_flight_at_scrape=8), 2),
    (LoadView("a", waiting=1, in_flight=9, in_flight_at_scrape=8), 0),
])
def test_headroom_counts_free_slots_when_the_engine_says_them(view, room):
    assert headroom(view, SaturationLimits(queue_depth=2)) == room


def test_occupied_and_pool_slots():
    assert occupied(LoadView("a", running=3, waiting=1, in_flight=2, in_flight_at_scrape=4)) == 2
    assert slots([LoadView("a", max_num_seqs=8), LoadView("b", max_num_seqs=4)]) == 12
    assert slots([LoadView("a", max_num_seqs=8), LoadView("b")]) == 0  # one does not say
    assert slots([]) == 0


def test_scraped_slots_reads_the_engine_gauge():
    text = ('vllm:num_requests_running{model_name="tiny"} 3.0\n'
            'kvpilot_max_num_seqs{model_name="tiny"} 8.0\n')
    assert scraped_slots(text) == 8
    assert scraped_slots('vllm:num_requests_running{model_name="tiny"} 3.0\n') == 0


class Engine:
    """One replica of `max_num_seqs` slots whose load is what flow control let through."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.running = 0

    def loads(self) -> list[LoadView]:
        return [LoadView("http://a", in_flight=self.running, max_num_seqs=self.max_num_seqs)]


async def until(condition, timeout: float = WAIT) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_the_shell_keeps_the_reserve_for_the_quiet_flow_until_responses_end():
    engine = Engine(max_num_seqs=4)
    flow = FlowControl(QueueLimits(), SaturationLimits(), engine.loads,
                       FlowMetrics(CollectorRegistry()), reserved_slots_fraction=0.5)
    held: list[Admission] = []

    async def request(name: str) -> None:
        admission = await flow.admit(FlowTicket(flow=name))
        engine.running += 1
        admission.begun()
        held.append(admission)

    flood = [asyncio.create_task(request("A")) for _ in range(6)]
    await until(lambda: len(held) == 4)  # alone, A fills every slot
    quiet = asyncio.create_task(request("B"))  # arrives: now A floods beside B
    await until(lambda: len(flow.queue) == 3)
    for n in range(3):  # three of A's end: their slots go to B, then stay free for B
        finished = next(a for a in held if a.key == ("A", 0))
        held.remove(finished)
        engine.running -= 1
        finished.ended()
        if n == 0:
            await asyncio.wait_for(quiet, WAIT)
        await asyncio.sleep(0.05)
    # 4 slots, 2 reserved: A holds 1 with B's 1 in flight (2 free: the reserve), none more
    assert sum(a.key == ("A", 0) for a in held) == 1
    assert flow.usage.in_flight == {("A", 0): 1, ("B", 0): 1}
    for admission in list(held):
        engine.running -= 1
        admission.ended()
        admission.ended()  # idempotent
    await asyncio.wait_for(asyncio.gather(*flood), WAIT)  # the rest go as slots free
    assert all(not t.cancelled() for t in flood)


async def test_router_holds_requests_to_the_engines_slots(fleet):
    """The router learns max_num_seqs from the engine's /metrics: it never has more streams
    open on it than that, the rest wait in its flow queue (not in the engine's)."""
    engine = FakeEngine("e1", chunks=3, stream_delay=0.05, max_num_seqs=2)
    router, _ = await fleet([engine], flow_control=True, reserved_slots_fraction=0.0)
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    async with httpx.AsyncClient(timeout=WAIT * 3) as client:
        assert (await client.post(f"{router}/v1/completions", json=body)).status_code == 200
        await asyncio.sleep(0.3)  # a scrape after the first request: slots known
        headers = {"x-gateway-inference-fairness-id": "A"}
        responses = await asyncio.gather(*(client.post(f"{router}/v1/completions", json=body,
                                                       headers=headers) for _ in range(8)))
        metrics = (await client.get(f"{router}/metrics")).text
    assert [r.status_code for r in responses] == [200] * 8
    assert engine.peak_streams == 2
    assert 'kvpilot_router_flow_requests_total{flow="A",outcome="dispatched",priority="0"} 8.0' \
        in metrics


@pytest.mark.parametrize(("key", "quiet", "priority"), [
    (("h", 10), True, -21), (("h", 10), False, -20), (B, True, -1), (A, False, 0),
    (("batch", -2), True, 3), (("batch", -2), False, 4)])
def test_the_engine_priority_keeps_bands_then_quiet_flows_first(key, quiet, priority):
    assert engine_priority(key, quiet) == priority


async def test_the_router_sends_the_engine_its_flow_control_order(fleet):
    """With flow control on, the body an engine gets carries the request's engine priority
    (the client's own is replaced: a client may not jump the engine's queue); without it,
    the client's stands."""
    engine = FakeEngine("e1", chunks=2)
    objectives = '[{"name": "high", "priority": 10}]'
    router, _ = await fleet([engine], flow_control=True, objectives=objectives)
    body = {"model": "tiny", "prompt": "hi", "stream": True, "priority": -100}
    async with httpx.AsyncClient(timeout=WAIT * 3) as client:
        for headers in ({"x-gateway-inference-fairness-id": "A"},
                        {"x-gateway-inference-fairness-id": "A",
                         "x-gateway-inference-objective": "high"}):
            response = await client.post(f"{router}/v1/completions", json=body, headers=headers)
            assert response.status_code == 200
    # each the only flow of its band: quiet
    assert [b["priority"] for b in engine.bodies] == [-1, -21]


async def test_without_flow_control_the_clients_priority_reaches_the_engine(fleet):
    engine = FakeEngine("e1", chunks=2)
    router, _ = await fleet([engine])
    body = {"model": "tiny", "prompt": "hi", "stream": True, "priority": -100}
    async with httpx.AsyncClient(timeout=WAIT * 3) as client:
        assert (await client.post(f"{router}/v1/completions", json=body)).status_code == 200
    assert [b["priority"] for b in engine.bodies] == [-100]
