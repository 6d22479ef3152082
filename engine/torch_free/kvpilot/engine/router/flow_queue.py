"""The router's flow-control queue as a pure value: bands, flows, and the rules between them.

A request waits here only while every replica is saturated (`router.saturation`). The rules:

- **bands**: a request's priority (an integer, higher first) is its band; a request of a
  higher band always leaves before any of a lower one;
- **fairness**: inside a band, flows (tenants, the fairness id) take turns one request at
  a time (round-robin, as a deficit round-robin with a quantum of one request), so a flow
  that floods waits behind itself, not in front of the others; inside a flow, first in,
  first out;
- **bounds**: a flow holds at most `max_queued_per_flow` requests and the queue at most
  `max_queued` in all; a request that finds its own flow full is shed; one that finds the
  whole queue full displaces the newest request of the lowest band below its own (the
  lowest band's longest flow first), else it is shed itself: shedding starts at the bottom;
- **time-out**: a request queued longer than `queue_timeout_s` leaves with a time-out;
- **disconnect**: a request whose client went away is removed wherever it waits.

Time is passed in, nothing here awaits or reads a clock: `flow_control.py` is the shell.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class QueueLimits:
    """The queue's bounds (`kvpilot route --max-queued-per-flow ...`)."""

    max_queued_per_flow: int = 64
    max_queued: int = 1024
    queue_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_queued_per_flow", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be at least 1")
        if self.max_queued_per_flow > self.max_queued:
            raise ValueError(f"max_queued_per_flow={self.max_queued_per_flow} is invalid: "
                             f"must be at most max_queued={self.max_queued}")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s={self.queue_timeout_s!r} is invalid: must be > 0")


@dataclass(eq=False)
class Waiter:
    """One queued request: its flow, its band and when it arrived (identity is the key)."""

    flow: str
    priority: int
    arrival: float
    deadline: float = field(default=float("inf"))  # set by `FlowQueue.offer`

    @property
    def key(self) -> tuple[str, int]:
        return self.flow, self.priority


@dataclass
class Band:
    """The flows of one priority, in their round-robin order (the next to serve first)."""

    flows: OrderedDict[str, deque[Waiter]] = field(default_factory=OrderedDict)
    size: int = 0


class FlowQueue:
    """Waiting requests by band and flow; every method is a pure state transition."""

    def __init__(self, limits: QueueLimits) -> None:
        self.limits = limits
        self.bands: dict[int, Band] = {}
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def queued(self, flow: str, priority: int) -> int:
        """Gives how many requests of `flow` wait in band `priority`."""
        band = self.bands.get(priority)
        return len(band.flows.get(flow, ())) if band else 0

    def flows(self) -> set[tuple[str, int]]:
        """Gives the (flow, band) pairs with a request queued."""
        return {(flow, priority) for priority, band in self.bands.items() for flow in band.flows}

    def offer(self, waiter: Waiter) -> list[Waiter]:
        """Queues `waiter`; gives the requests shed to bound the queue (maybe `waiter`)."""
        waiter.deadline = waiter.arrival + self.limits.queue_timeout_s
        if self.queued(waiter.flow, waiter.priority) >= self.limits.max_queued_per_flow:
            return [waiter]
        shed: list[Waiter] = []
        if self.size >= self.limits.max_queued:
            lowest = min(self.bands)
            if lowest >= waiter.priority:
                return [waiter]
            shed.append(self._displace(lowest))
        band = self.bands.setdefault(waiter.priority, Band())
        band.flows.setdefault(waiter.flow, deque()).append(waiter)
        band.size += 1
        self.size += 1
        return shed

    def pop(self, eligible: Callable[[Waiter], bool] = lambda w: True) -> Waiter | None:
        """Gives the next request to dispatch and takes it out: the highest band first, flows
        in turn inside a band; a flow whose head is not `eligible` (an objective no replica
        meets yet) is passed over this time, keeping its place in the turn."""
        for priority in sorted(self.bands, reverse=True):
            band = self.bands[priority]
            for flow, waiters in band.flows.items():
                if eligible(waiters[0]):
                    waiter = waiters.popleft()
                    band.flows.move_to_end(flow)  # its turn is used: the next flow goes first
                    self._shrink(priority, band, flow)
                    return waiter
        return None

    def remove(self, waiter: Waiter) -> bool:
        """Takes out a request whose client went away; gives whether it was queued."""
        band = self.bands.get(waiter.priority)
        waiters = band.flows.get(waiter.flow) if band else None
        if band is None or waiters is None or waiter not in waiters:
            return False
        waiters.remove(waiter)
        self._shrink(waiter.priority, band, waiter.flow)
        return True

    def expire(self, now: float) -> list[Waiter]:
        """Takes out and gives the requests whose queue time-out passed at `now`."""
        late = [w for w in self if w.deadline <= now]
        for waiter in late:
            self.remove(waiter)
        return late

    def next_deadline(self) -> float:
        """Gives the earliest time-out of a queued request (inf when none waits)."""
        return min((waiters[0].deadline for band in self.bands.values()
                    for waiters in band.flows.values()), default=float("inf"))

    def __iter__(self) -> Iterator[Waiter]:
        for band in self.bands.values():
            for waiters in band.flows.values():
                yield from waiters

    def _displace(self, priority: int) -> Waiter:
        """Takes out the newest request of band `priority`'s longest flow."""
        band = self.bands[priority]
        flow = max(band.flows, key=lambda f: len(band.flows[f]))
        waiter = band.flows[flow].pop()
        self._shrink(priority, band, flow)
        return waiter

    def _shrink(self, priority: int, band: Band, flow: str) -> None:
        band.size -= 1
        self.size -= 1
        if not band.flows[flow]:
            del band.flows[flow]
        if not band.flows:
            del self.bands[priority]


def retry_after_s(queued: int, dispatch_per_s: float, longest: float = 60.0) -> int:
    """Gives the Retry-After seconds of a shed request: how long the requests queued now take
    to leave at the recent dispatch rate, at least 1 and at most `longest`."""
    if dispatch_per_s <= 0:
        return math.ceil(longest)
    return math.ceil(min(max(1.0, queued / dispatch_per_s), longest))
