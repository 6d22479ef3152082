"""A request's tries before its first byte: where the next may go, how many, how long it holds.

Before the first byte nothing reached the client, so sending the request again is safe even
for a request that is not idempotent. The rule (`proxy.Forwarder`; a moving stream's
continuation follows it too):

- A try goes to an instance the request has not failed on, or to one that failed it and has
  answered the router since (a restarted replica's health check, a stalled one's first byte
  after SIGCONT): it "came back". A stream's continuation never goes back to the instance it
  left.
- 1 + `--max-retries` tries; once they all failed, or every instance it may try failed it,
  the request holds and gets up to `--max-retries` more, each as soon as an instance it may
  try is ready.
- It holds until `--hold-timeout` after its first failure (never past `--request-timeout`),
  then ends with an error naming the bound that ended it. Tries that all got 429 end at
  once with 429 instead (the fleet is busy, not broken: the client backs off), except a
  continuation's, which holds like any other.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpilot.engine.router.stall import Watched


@dataclass
class Tries:
    """What one request's tries before its first byte came to, and what is left of them."""

    max_retries: int
    hold_timeout: float
    deadline: float  # the request's: arrival + --request-timeout
    never: frozenset[str] = frozenset()  # the instance a continuation left
    busy_holds: bool = False  # a continuation holds through 429s; a new request answers 429
    hold_until: float | None = None  # set by the first failure (a continuation: the break)
    failed_at: dict[str, float] = field(default_factory=dict)  # url -> its last failure
    made: int = 0
    held: bool = False  # it began to hold: its last max_retries tries are granted
    all_busy: bool = True  # every failure so far was a 429
    last_error: str = "no instance tried"
    budget: int = field(init=False)

    def __post_init__(self) -> None:
        self.budget = 1 + self.max_retries

    def excluded(self, instances: Mapping[str, Watched]) -> set[str]:
        """Gives the URLs the next try may not go to: those that failed it and have not
        answered since, and the instance a continuation left."""
        def back(url: str, at: float) -> bool:
            instance = instances.get(url)
            return instance is not None and instance.last_heard > at
        return set(self.never) | {url for url, at in self.failed_at.items() if not back(url, at)}

    def started(self) -> None:
        """Counts a try sent."""
        self.made += 1

    def failed(self, url: str, error: str, busy: bool, now: float | None = None) -> None:
        """Notes that the try on `url` failed (`busy`: with a 429); the first failure starts
        the hold time."""
        now = time.monotonic() if now is None else now
        self.failed_at[url] = now
        self.last_error = f"{url}: {error}"
        self.all_busy = self.all_busy and busy
        if self.hold_until is None:
            self.start_hold_time(now)

    def start_hold_time(self, now: float) -> None:
        """Starts the hold time at `now` (a continuation's: its stream's break)."""
        self.hold_until = min(now + self.hold_timeout, self.deadline)

    @property
    def answer_busy(self) -> bool:
        """Whether it ends now with 429: every try was refused as busy (new requests only)."""
        return self.made > 0 and self.all_busy and not self.busy_holds

    def hold(self) -> bool:
        """Begins holding (once: the last max_retries tries); gives whether a try is left."""
        if not self.held:
            self.held = True
            self.budget = self.made + self.max_retries
        return self.made < self.budget

    def left(self, now: float) -> float:
        """Gives the seconds of hold time left (the request's own time before any failure)."""
        end = self.deadline if self.hold_until is None else self.hold_until
        return max(end - now, 0.0)

    def why(self, now: float | None = None) -> str:
        """Gives why no try succeeded, naming the flag whose bound ended them."""
        now = time.monotonic() if now is None else now
        tried = f"all {self.made} attempts failed" if self.made else "no attempt was made"
        if self.held and self.made >= self.budget:
            bound = (f"--max-retries={self.max_retries} bounds the retries, and as many again "
                     "once it holds for an instance to come back")
        elif now >= self.deadline:
            bound = "--request-timeout ran out"
        else:
            bound = (f"no instance it had not failed on was ready, and none came back, within "
                     f"--hold-timeout={self.hold_timeout:g}s")
        return f"{tried} ({bound}); last: {self.last_error}"
