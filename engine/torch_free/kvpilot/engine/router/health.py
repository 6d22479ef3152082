"""Per-instance health: outlier ejection after consecutive failures, with backoff.

An instance that fails `eject_after_failures` times in a row (refused connection,
5xx, a stream cut mid-way, a failed /metrics scrape) is left out of routing for
`eject_seconds`, doubling on each repeat up to 8x. When the time is up it is tried
again; one success clears its record. A stalled instance (`router.stall`) is out until it
answers again.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF = 8


@dataclass
class Health:
    """An instance's failure record."""

    consecutive_failures: int = 0
    ejections: int = 0  # times ejected since the last success
    ejected_until: float = 0.0
    stalled: bool = False  # out of rotation until it answers again (`router.stall`)

    def available(self, now: float) -> bool:
        """Gives whether the instance may receive requests at `now`."""
        return not self.stalled and now >= self.ejected_until

    def record_success(self) -> None:
        """Clears the failure record."""
        self.consecutive_failures = 0
        self.ejections = 0

    def record_failure(self, now: float, eject_after: int, eject_seconds: float) -> bool:
        """Counts a failure; gives True when it ejects the instance."""
        self.consecutive_failures += 1
        if self.consecutive_failures < eject_after or not self.available(now):
            return False
        backoff = min(2 ** self.ejections, MAX_BACKOFF)
        self.ejections += 1
        self.ejected_until = now + eject_seconds * backoff
        # Once back, a single further failure ejects it again (it is on probation).
        self.consecutive_failures = eject_after - 1
        return True
