"""Who may take the pool's last free slots: a reserve kept for the quiet flows.

An engine runs at most `max_num_seqs` requests and does not preempt a running one for a
waiting one, so once a flood holds every slot a quiet flow's request waits for one of the
flood's to finish, however early it leaves the router's queue. The rule, per flow and band
(a tenant sending in two bands is two flows here, as in the queue):

- the pool's **slots** are its ready replicas' `max_num_seqs` (scraped
  `kvpilot_max_num_seqs`);
- a flow is **active** while it has a request in flight or queued, or sent one within the
  last `WINDOW_S` (a quiet flow between two requests still counts);
- a flow is **quiet** when it sent fewer than its fair share of its band's requests in that
  window (fewer than 1/n of them, n the band's active flows) or is its band's only flow;
- the last `reserve` free slots (`ceil(reserved_slots_fraction * slots)`) go only to quiet
  flows of the highest active band: any other request takes a slot only while more than
  `reserve` are free. So a flood holds at most `slots - reserve` while anyone else sends,
  the whole pool while nobody does, and a lower band never holds the slots a higher band's
  next request needs.

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

FlowKey = tuple[str, int]  # (flow, priority band)


def reserve_of(slots: int, reserved_slots_fraction: float) -> int:
    """Gives the free slots kept for quiet flows."""
    return math.ceil(reserved_slots_fraction * slots - 1e-9) if slots > 0 else 0


@dataclass
class FlowUsage:
    """Each flow's requests in flight and its arrivals in the window, by (flow, band)."""

    in_flight: Counter[FlowKey] = field(default_factory=Counter)
    arrivals: deque[tuple[float, FlowKey]] = field(default_factory=deque)
    recent: Counter[FlowKey] = field(default_factory=Counter)  # arrivals in the window

    def arrived(self, key: FlowKey, now: float) -> None:
        self.arrivals.append((now, key))
        self.recent[key] += 1

    def dispatched(self, key: FlowKey) -> None:
        self.in_flight[key] += 1

    def ended(self, key: FlowKey) -> None:
        self.in_flight[key] -= 1
        if self.in_flight[key] <= 0:
            del self.in_flight[key]

    def active(self, now: float, queued: set[FlowKey]) -> set[FlowKey]:
        """Gives the flows active at `now` (`queued`: those with a request queued); forgets
        the arrivals older than the window."""
        while self.arrivals and self.arrivals[0][0] < now - WINDOW_S:
            _, key = self.arrivals.popleft()
            self.recent[key] -= 1
            if not self.recent[key]:
                del self.recent[key]
        return set(self.recent) | set(self.in_flight) | queued

    def taker(self, now: float, queued: set[FlowKey], slots: int,
              reserved_slots_fraction: float) -> Callable[[FlowKey, int], bool]:
        """Gives, as of `now` for a pool of `slots`, whether a request of a flow may take
        one of `room` free slots (`queued`: the flows with a request queued)."""
        flows = Counter(priority for _, priority in self.active(now, queued))
        top = max(flows, default=0)
        reserve = reserve_of(slots, reserved_slots_fraction)
        sent = Counter()
        for (_, priority), n in self.recent.items():
            sent[priority] += n

        def may_take(key: FlowKey, room: int) -> bool:
            if room <= 0:
                return False
            if room > reserve:
                return True
            band = key[1]
            quiet = flows[band] <= 1 or self.recent[key] * flows[band] < sent[band]
            return band >= top and quiet
        return may_take
