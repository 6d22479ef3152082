"""Repeated warnings summarised: the first of a kind is logged at once, the rest at most once
per interval as a count.

A port scan of a KV agent (316 bad connections were 316 WARNING lines) or a router polling an
engine that refuses it (a line every refresh) buried the lines that mattered. The first
warning still says what happened; later ones say how many more there were.
Torch-free: the router uses it too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_INTERVAL = 60.0  # seconds between two lines of one kind
# Past this many kinds (one per peer) new ones share one count, so a scan from many
# addresses cannot grow the table without bound.
MAX_KEYS = 1024
OTHER_KEY = "other peers"


@dataclass
class _Kind:
    logged_at: float  # when its last line went out
    held: int = 0  # warnings since then that were not logged


class RepeatedWarnings:
    """Logs warnings of one kind (a key, such as the peer's address) at most once per
    `interval` seconds; the held-back ones are counted in a line of their own."""

    def __init__(self, logger: logging.Logger, what: str, interval: float = DEFAULT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what, self.interval, self.clock = logger, what, interval, clock
        self._kinds: dict[str, _Kind] = {}

    def warn(self, key: str, message: str, *args: object) -> bool:
        """Logs `message % args` unless `key` logged within the interval (then counts it);
        gives whether it logged."""
        now = self.clock()
        if key not in self._kinds and len(self._kinds) >= MAX_KEYS:
            key = OTHER_KEY
        kind = self._kinds.get(key)
        if kind is not None and now - kind.logged_at < self.interval:
            kind.held += 1
            return False
        if kind is not None and kind.held:
            self._summarise(key, kind, now)
        self._kinds[key] = _Kind(now)
        self.logger.warning(message, *args)
        return True

    def flush(self) -> None:
        """Logs the count of each kind whose interval has passed with warnings held back, and
        forgets the kinds quiet for a whole interval (call it periodically)."""
        now = self.clock()
        for key, kind in list(self._kinds.items()):
            if now - kind.logged_at < self.interval:
                continue
            if kind.held:
                self._summarise(key, kind, now)
                self._kinds[key] = _Kind(now)
            else:
                del self._kinds[key]

    def _summarise(self, key: str, kind: _Kind, now: float) -> None:
        self.logger.warning("%d more %s from %s in the last %.0f s", kind.held, self.what, key,
                            now - kind.logged_at)
