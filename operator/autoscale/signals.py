"""One scrape of a pool reduced to per-replica signal values, and each signal's vote."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.operator.autoscale.spec import (
    ITL,
    KV_CACHE,
    LATENCY_SIGNALS,
    QUEUE_DEPTH,
    RUNNING_REQUESTS,
    TTFT,
    WAITING_PROMPT_TOKENS,
)


@dataclass(frozen=True)
class PoolMetrics:
    """What the pool's pods reported at one time (totals over the pods that answered)."""

    time: float
    replicas_reporting: int
    """Pods whose /metrics answered; the others count as missing data."""
    kv_cache_utilization: float | None = None
    """Mean fraction of KV blocks in use over the reporting pods."""
    requests_waiting: float | None = None
    requests_running: float | None = None
    waiting_prompt_tokens: float | None = None
    ttft_p90_seconds: float | None = None
    itl_p90_seconds: float | None = None
    demand: int = 0
    """Requests the router holds for this pool because no replica is ready."""


@dataclass(frozen=True)
class Vote:
    """One signal's recommendation."""

    signal: str
    value: float
    """Observed per-replica value (latency signals: seconds)."""
    target: float
    replicas: int


def per_replica_values(metrics: PoolMetrics) -> dict[str, float | None]:
    """Gives each signal's observed per-replica value (None where the pods did not report it)."""
    n = metrics.replicas_reporting

    def per(total: float | None) -> float | None:
        return None if total is None or n == 0 else total / n

    return {
        KV_CACHE: metrics.kv_cache_utilization if n else None,
        QUEUE_DEPTH: per(metrics.requests_waiting),
        WAITING_PROMPT_TOKENS: per(metrics.waiting_prompt_tokens),
        RUNNING_REQUESTS: per(metrics.requests_running),
        TTFT: metrics.ttft_p90_seconds,
        ITL: metrics.itl_p90_seconds,
    }


def _ceil(x: float) -> int:
    # Guards against 2.0000000001 becoming 3 after a division.
    return math.ceil(x - 1e-9)


def vote(signal: str, value: float, target: float, replicas: int,
         tolerance: float) -> Vote | None:
    """Gives the signal's replica count: ceil(replicas × value / target) outside the tolerance.

    Inside the band the signal votes for `replicas` (no change). Latency signals
    only vote up: latency has a floor at the unloaded step time, so a low value
    says nothing about how many replicas could go; None means no opinion.
    """
    ratio = value / target
    if abs(ratio - 1.0) <= tolerance:
        return Vote(signal, value, target, replicas)
    if signal in LATENCY_SIGNALS and ratio < 1.0:
        return None
    return Vote(signal, value, target, _ceil(replicas * ratio))
