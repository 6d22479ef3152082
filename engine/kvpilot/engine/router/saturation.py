"""When a replica is saturated, and how many more requests the pool takes before it is.

A replica is saturated when its KV cache is nearly full (scraped
`vllm:kv_cache_usage_perc` at or above the limit) or when its engine queue reaches the
queue-depth limit. The engine queue is scraped (`vllm:num_requests_waiting`) only every
refresh, so the router advances it by what it has itself sent to the replica since that
scrape, less what finished: `waiting + in_flight - in_flight_at_scrape`. Between two scrapes
a replica therefore takes at most `queue_depth` more requests than finished on it, and a
flood cannot fill an engine's queue behind the router's back. The pool is saturated when
every ready replica is; the router then holds requests in its flow queue (`flow_queue`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SaturationLimits:
    """Where a replica counts as saturated (`--saturation-queue-depth`, `--saturation-kv-usage`)."""

    queue_depth: int = 2
    kv_usage: float = 0.95

    def __post_init__(self) -> None:
        if self.queue_depth < 1:
            raise ValueError(f"saturation_queue_depth={self.queue_depth!r} is invalid: must be "
                             "at least 1 (requests an engine may queue before the router holds)")
        if not 0 < self.kv_usage <= 1:
            raise ValueError(f"saturation_kv_usage={self.kv_usage!r} is invalid: must be in "
                             "(0, 1]")


@dataclass(frozen=True)
class LoadView:
    """One ready replica's load as flow control sees it."""

    url: str
    waiting: float = 0.0  # scraped vllm:num_requests_waiting
    in_flight: int = 0  # requests the router has open on it now
    in_flight_at_scrape: int = 0  # ... when `waiting` was scraped
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc


def queue_estimate(view: LoadView) -> float:
    """Gives the replica's engine queue: scraped, advanced by the router's sends since."""
    return max(0.0, view.waiting + view.in_flight - view.in_flight_at_scrape)


def headroom(view: LoadView, limits: SaturationLimits) -> int:
    """Gives how many more requests the replica takes before it is saturated."""
    if view.kv_usage >= limits.kv_usage:
        return 0
    return max(0, math.ceil(limits.queue_depth - queue_estimate(view)))


def pool_headroom(views: Sequence[LoadView], limits: SaturationLimits) -> int | None:
    """Gives how many more requests the pool takes; None when no replica is ready (not flow
    control's call: the router holds those requests for a replica, `hold_timeout`)."""
    if not views:
        return None
    return sum(headroom(view, limits) for view in views)
