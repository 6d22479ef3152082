"""Who may take the pool's last free slots: a reserve kept for the quiet flows.

An engine runs at most `max_num_seqs` requests and does not preempt a running one for a
waiting one, so once a flood holds every slot a quiet flow's request waits for one of the
flood's to finish, however early it leaves the router's queue. The rule, per flow and band
(a tenant sending in two bands is two flows here, as in the queue):

- the pool's **slots** are its ready replicas' `max_num_seqs` (scraped
  `kvpilot_max_num_seqs`);
- a flow is **active** while it has a request in flight or queued, or sent one within the
  last `WINDOW_S` (a quiet flow between two requests still counts);
- a flow's **rate** is its arrivals in that window over the time from the first of them to
  the last (at least `RATE_FLOOR_S`): what it sends while it sends. A flood that began a
  moment ago is a flood at once, where a count over the whole window made it look quieter
  than a steady flow for its first second (measured: the flood's first requests took the
  reserve, the quiet flow's next ones waited ~1 s for a slot,
  `bench/results/flow_control-CPU-2026-12-05`); and a flow that stopped keeps its rate
  until it leaves the window, where a rate up to now decayed and made a steady flow the
  heavier one of the two (its requests then waited for slots held by nobody else);
- a flow is **quiet** when its rate is under its fair share of its band's (under 1/n of
  the band's summed rates, n the band's active flows) or it is its band's only flow;
- the last `reserve` free slots (`ceil(reserved_slots_fraction * slots)`) go only to quiet
  flows of the highest active band: any other request takes a slot only while more than
  `reserve` are free. So a flood holds at most `slots - reserve` while anyone else sends,
  the whole pool while nobody does, and a lower band never holds the slots a higher band's
  next request needs.

The same order goes on inside the engines: a request let through carries
`engine_priority` (higher bands first, quiet flows first inside a band) as its body's
`priority`, which engines run with `--scheduling-policy priority` honour, so a quiet flow's
request does not wait in an engine's queue behind a flood's requests sent a moment before
(measured: 20-80 ms of the quiet flow's slowest TTFTs under a flood,
`bench/results/flow_control-CPU-2026-12-05`).

Demand, not service, decides who is quiet: a flood that the reserve squeezes stays a flood
(counting what it got instead would make the quiet flow the "heavy" one and idle the
reserve). Time is passed in; `flow_control.py` is the shell.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW_S = 10.0
# the shortest span a flow's rate is measured over: a flood's first two requests, a few ms
# apart, are already 4/s (more than a steady flow of 3/s), one request of a flow silent until
# now no more than 2/s
RATE_FLOOR_S = 0.5

FlowKey = tuple[str, int]  # (flow, priority band)


def reserve_of(slots: int, reserved_slots_fraction: float) -> int:
    """Gives the free slots kept for quiet flows."""
    return math.ceil(reserved_slots_fraction * slots - 1e-9) if slots > 0 else 0


@dataclass
class FlowUsage:
    """Each flow's requests in flight and its arrival times in the window, by (flow, band)."""

    in_flight: Counter[FlowKey] = field(default_factory=Counter)
    arrivals: dict[FlowKey, deque[float]] = field(default_factory=dict)  # in the window

    def arrived(self, key: FlowKey, now: float) -> None:
        self.arrivals.setdefault(key, deque()).append(now)

    def dispatched(self, key: FlowKey) -> None:
        self.in_flight[key] += 1

    def ended(self, key: FlowKey) -> None:
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]

    def active(self, now: float, queued: set[FlowKey]) -> set[FlowKey]:
        """Gives the flows active at `now` (`queued`: those with a request queued); forgets
        the arrivals older than the window."""
        for key in list(self.arrivals):
            times = self.arrivals[key]
            while times and times[0] < now - WINDOW_S:
                times.popleft()
            if not times:
                del self.arrivals[key]
        return set(self.arrivals) | set(self.in_flight) | queued

    def rate(self, key: FlowKey) -> float:
        """Gives the flow's arrivals per second: those in the window over the time from the
        first of them to the last, at least RATE_FLOOR_S (`active` trims the window)."""
        times = self.arrivals.get(key)
        if not times:
            return 0.0
        return len(times) / max(times[-1] - times[0], RATE_FLOOR_S)

    def quiet(self, now: float, queued: set[FlowKey]) -> Callable[[FlowKey], bool]:
        """Gives, as of `now`, whether a flow is quiet: its band's only active flow, or its
        rate under 1/n of its band's (`queued`: the flows with a request queued)."""
        active = self.active(now, queued)
        flows = Counter(priority for _, priority in active)
        rates = {key: self.rate(key) for key in active}
        band_rate: dict[int, float] = {}
        for (_, priority), rate in rates.items():
            band_rate[priority] = band_rate.get(priority, 0.0) + rate

        def is_quiet(key: FlowKey) -> bool:
            n = flows[key[1]]
            return n <= 1 or rates.get(key, 0.0) * n < band_rate.get(key[1], 0.0)
        return is_quiet

    def top_band(self, now: float, queued: set[FlowKey]) -> int:
        """Gives the highest band with an active flow (0 when none is)."""
        return max((priority for _, priority in self.active(now, queued)), default=0)

    def taker(self, now: float, queued: set[FlowKey], slots: int,
              reserved_slots_fraction: float) -> Callable[[FlowKey, int], bool]:
        """Gives, as of `now` for a pool of `slots`, whether a request of a flow may take
        one of `room` free slots (`queued`: the flows with a request queued)."""
        top = self.top_band(now, queued)
        quiet = self.quiet(now, queued)
        reserve = reserve_of(slots, reserved_slots_fraction)

        def may_take(key: FlowKey, room: int) -> bool:
            if room <= 0:
                return False
            if room > reserve:
                return True
            return key[1] >= top and quiet(key)
        return may_take


def engine_priority(key: FlowKey, quiet: bool) -> int:
    """Gives the `priority` a request of flow `key` carries to its engine (lower runs first
    under `--scheduling-policy priority`): higher bands first, and inside a band the quiet
    flows first, so the engine's waiting queue keeps flow control's order."""
    return -(2 * key[1] + quiet)
