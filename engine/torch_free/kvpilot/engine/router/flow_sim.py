"""Flows and priorities in simulation: the router's own flow-control rules in front of
modelled replicas, so a policy can be compared before it runs on a fleet (`kvpilot sim
--flows SCENARIO.json`).

Discrete events on a heap. Each flow sends Poisson arrivals of one request shape. A replica
runs up to `max_num_seqs` requests at once and queues the rest first in, first out, as the
engine's scheduler does; a request takes `prompt_tokens / prefill_tokens_per_s` to its first
token and then `output_tokens * decode_step_s`. With flow control on, the router holds
requests in the real `FlowQueue` and dispatches by the real `saturation` rule (free slots
when `slots_known`, the replicas' `kvpilot_max_num_seqs`; else the engine queue depth) and
the real `flow_share` reserve (`reserved_slots_fraction`); the sim sees each engine
exactly, where the router sees it through scrapes and its own sends. With flow control off,
every request goes at once to the replica with the fewest requests. What it leaves out:
batch size slowing a step, prefix caching, the network.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpilot.engine.router.flow_queue import FlowQueue, QueueLimits, Waiter
from kvpilot.engine.router.flow_share import FlowKey, FlowUsage
from kvpilot.engine.router.saturation import LoadView, SaturationLimits, headroom, slots


@dataclass(frozen=True)
class FlowSpec:
    """One flow's traffic."""

    name: str
    rate: float  # requests per second
    priority: int = 0
    prompt_tokens: float = 400.0
    output_tokens: float = 48.0


@dataclass(frozen=True)
class FlowScenario:
    """A fleet, its flows and the router's settings."""

    flows: tuple[FlowSpec, ...]
    replicas: int = 1
    max_num_seqs: int = 8
    prefill_tokens_per_s: float = 8000.0
    decode_step_s: float = 0.02
    duration_s: float = 120.0
    seed: int = 0
    flow_control: bool = True
    saturation_queue_depth: int = 1
    slots_known: bool = True  # the engines export kvpilot_max_num_seqs
    reserved_slots_fraction: float = 0.125  # the router's default
    max_queued_per_flow: int = 64
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0

    @staticmethod
    def from_json(data: dict[str, Any]) -> FlowScenario:
        """Gives the scenario of a JSON object; a ValueError naming the field otherwise."""
        known = set(FlowScenario.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown scenario field(s) {sorted(unknown)}: use {sorted(known)}")
        flows = data.get("flows")
        if not isinstance(flows, list) or not flows:
            raise ValueError("flows must be a non-empty list of {name, rate, priority, "
                             "prompt_tokens, output_tokens}")
        try:
            parsed = tuple(FlowSpec(**f) for f in flows)
        except TypeError as exc:
            raise ValueError(f"flows: {exc}") from None
        for n, f in enumerate(parsed):
            if not f.rate > 0:
                raise ValueError(f"flows[{n}].rate={f.rate!r} is invalid: must be > 0")
        reserved = data.get("reserved_slots_fraction", 0.125)
        if not 0 <= reserved < 1:
            raise ValueError(f"reserved_slots_fraction={reserved!r} is invalid: must be in "
                             "[0, 1)")
        return FlowScenario(**{**data, "flows": parsed})


@dataclass
class Request:
    flow: FlowSpec
    arrival: float
    waiter: Waiter | None = None
    start: float = 0.0


@dataclass
class Replica:
    max_num_seqs: int  # what the router knows of it (0: nothing)
    running: int = 0
    queue: deque[Request] = field(default_factory=deque)

    def view(self, url: str) -> LoadView:
        load = self.running + len(self.queue)
        return LoadView(url, waiting=len(self.queue), in_flight=load, in_flight_at_scrape=load,
                        running=self.running, max_num_seqs=self.max_num_seqs)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def simulate_flows(scenario: FlowScenario) -> dict[str, Any]:
    """Gives each flow's outcome: sent, served, shed (429s), TTFT p50/p99 in seconds."""
    rng = random.Random(scenario.seed)
    replicas = [Replica(scenario.max_num_seqs if scenario.slots_known else 0)
                 for _ in range(scenario.replicas)]
    usage = FlowUsage()
    limits = SaturationLimits(scenario.saturation_queue_depth)
    queue = FlowQueue(QueueLimits(scenario.max_queued_per_flow, scenario.max_queued_requests,
                                  scenario.queue_timeout_s))
    held: dict[Waiter, Request] = {}
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    ttft: dict[str, list[float]] = {f.name: [] for f in scenario.flows}
    sent = dict.fromkeys(ttft, 0)
    shed = dict.fromkeys(ttft, 0)
    for flow in scenario.flows:
        heapq.heappush(events, (rng.expovariate(flow.rate), next(order), "arrive", flow))

    def start(replica: Replica, request: Request, now: float) -> None:
        replica.running += 1
        prefill = request.flow.prompt_tokens / scenario.prefill_tokens_per_s
        ttft[request.flow.name].append(now - request.arrival + prefill)
        done = now + prefill + request.flow.output_tokens * scenario.decode_step_s
        heapq.heappush(events, (done, next(order), "finish", (replica, request)))

    def send(request: Request, now: float) -> None:
        usage.dispatched((request.flow.name, request.flow.priority))
        views = [(headroom(r.view(str(n)), limits), -r.running - len(r.queue), n)
                 for n, r in enumerate(replicas)]
        replica = replicas[max(views)[2]]
        if replica.running < scenario.max_num_seqs:
            start(replica, request, now)
        else:
            replica.queue.append(request)

    def room() -> int:
        return sum(headroom(r.view(str(n)), limits) for n, r in enumerate(replicas))

    def taker(now: float) -> Callable[[FlowKey, int], bool]:
        pool = slots([r.view(str(n)) for n, r in enumerate(replicas)])
        return usage.taker(now, queue.flows(), pool, scenario.reserved_slots_fraction)

    def drain(now: float) -> None:
        for waiter in queue.expire(now):
            shed[waiter.flow] += 1
            del held[waiter]
        may_take = taker(now)
        while queue and (free := room()) > 0:
            waiter = queue.pop(lambda w: may_take(w.key, free))
            if waiter is None:
                return
            send(held.pop(waiter), now)

    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "arrive":
            flow: FlowSpec = item
            nxt = now + rng.expovariate(flow.rate)
            if nxt < scenario.duration_s:
                heapq.heappush(events, (nxt, next(order), "arrive", flow))
            sent[flow.name] += 1
            key = (flow.name, flow.priority)
            usage.arrived(key, now)
            request = Request(flow, now)
            if not scenario.flow_control or (not queue and taker(now)(key, room())):
                send(request, now)
                continue
            request.waiter = Waiter(flow.name, flow.priority, now)
            held[request.waiter] = request
            for out in queue.offer(request.waiter):
                shed[out.flow] += 1
                del held[out]
            drain(now)
        else:
            replica, done = item
            replica.running -= 1
            usage.ended((done.flow.name, done.flow.priority))
            if replica.queue:
                start(replica, replica.queue.popleft(), now)
            drain(now)
    # `held` is empty here: every queued request left by dispatch, shedding or time-out
    return {f.name: {"sent": sent[f.name], "served": len(ttft[f.name]), "shed": shed[f.name],
                     "lost": sent[f.name] - len(ttft[f.name]) - shed[f.name],
                     "ttft_p50_s": _percentile(ttft[f.name], 0.5),
                     "ttft_p99_s": _percentile(ttft[f.name], 0.99)}
            for f in scenario.flows}


def compare(scenario: FlowScenario) -> dict[str, Any]:
    """Gives the scenario's outcome with flow control on and off, and the scenario itself."""
    on = simulate_flows(FlowScenario(**{**asdict(scenario), "flows": scenario.flows,
                                        "flow_control": True}))
    off = simulate_flows(FlowScenario(**{**asdict(scenario), "flows": scenario.flows,
                                         "flow_control": False}))
    return {"scenario": json.loads(json.dumps(asdict(scenario))), "flow_control_on": on,
            "flow_control_off": off}
