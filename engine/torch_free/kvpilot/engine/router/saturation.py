"""When a replica is saturated, and how many more requests the pool takes before it is.

A replica is saturated when its KV cache is nearly full (scraped
`vllm:kv_cache_usage_perc` at or above the limit) or when it has no room left:

- **slots**, when the engine exports `kvpilot_max_num_seqs`: its requests (scraped
  `vllm:num_requests_running` plus `vllm:num_requests_waiting`, advanced by what the router
  itself sent since that scrape less what finished, and never fewer than the router has open
  on it) fill its `max_num_seqs`. The engine's own queue then stays empty: a request leaves
  the router's flow queue only for a free slot, so the flow queue, not the engine's first in
  first out, decides who runs next (`flow_share` keeps the last slots for quiet flows);
- **queue depth**, for an engine that does not say its slots: its queue, scraped
  `vllm:num_requests_waiting` advanced the same way (`waiting + in_flight -
  in_flight_at_scrape`), reaches `queue_depth`.

Scrapes come every refresh; counting the router's own sends at once means a flood cannot
fill an engine behind the router's back between two scrapes. The pool is saturated when
every ready replica is; the router then holds requests in its flow queue (`flow_queue`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.metrics_text import read_metrics


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
    running: float = 0.0  # scraped vllm:num_requests_running
    max_num_seqs: int = 0  # scraped kvpilot_max_num_seqs; 0: the engine does not say


def scraped_slots(text: str) -> int:
    """Gives an engine's max_num_seqs from its /metrics text; 0 when it does not say."""
    gauges, _ = read_metrics(text, (names.MAX_NUM_SEQS,))
    return int(gauges.get(names.MAX_NUM_SEQS, 0))


def queue_estimate(view: LoadView) -> float:
    """Gives the replica's engine queue: scraped, advanced by the router's sends since."""
    return max(0.0, view.waiting + view.in_flight - view.in_flight_at_scrape)


def occupied(view: LoadView) -> float:
    """Gives the requests on the replica: scraped running and waiting, advanced by the
    router's sends since, never fewer than the router has open on it."""
    return max(float(view.in_flight),
               view.running + view.waiting + view.in_flight - view.in_flight_at_scrape)


def slots(views: Sequence[LoadView]) -> int:
    """Gives the pool's slots: its replicas' max_num_seqs (0 when any does not say)."""
    if not views or any(v.max_num_seqs <= 0 for v in views):
        return 0
    return sum(v.max_num_seqs for v in views)


def headroom(view: LoadView, limits: SaturationLimits) -> int:
    """Gives how many more requests the replica takes before it is saturated: its free
    slots when it says its max_num_seqs, else what its queue takes up to the depth."""
    if view.kv_usage >= limits.kv_usage:
        return 0
    if view.max_num_seqs > 0:
        return max(0, math.floor(view.max_num_seqs - occupied(view) + 1e-9))
    return max(0, math.ceil(limits.queue_depth - queue_estimate(view)))


def pool_headroom(views: Sequence[LoadView], limits: SaturationLimits) -> int | None:
    """Gives how many more requests the pool takes; None when no replica is ready (not flow
    control's call: the router holds those requests for a replica, `hold_timeout`)."""
    if not views:
        return None
    return sum(headroom(view, limits) for view in views)
