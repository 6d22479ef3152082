"""One scrape of a pool reduced to per-replica signal values, and each signal's vote."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

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
    startup_seconds: float | None = None
    """The longest start-up (load, CUDA graphs, warm-up) a reporting engine took."""

    @cached_property
    def per_replica(self) -> dict[str, float | None]:
        """Gives each signal's observed per-replica value (None where pods did not report it).

        Cached: every sample is averaged into several decisions (the metrics window).
        """
        n = self.replicas_reporting

        def per(total: float | None) -> float | None:
            return None if total is None or n == 0 else total / n

        return {
            KV_CACHE: self.kv_cache_utilization if n else None,
            QUEUE_DEPTH: per(self.requests_waiting),
            WAITING_PROMPT_TOKENS: per(self.waiting_prompt_tokens),
            RUNNING_REQUESTS: per(self.requests_running),
            TTFT: self.ttft_p90_seconds,
            ITL: self.itl_p90_seconds,
        }


@dataclass(frozen=True)
class Vote:
    """One signal's recommendation."""

    signal: str
    value: float
    """Observed per-replica value (latency signals: seconds)."""
    target: float
    replicas: int


def smoothed_values(history: Sequence[PoolMetrics], window_s: float,
                    now: float) -> dict[str, float | None]:
    """Gives each signal's mean per-replica value over the recent samples at today's size.

    Only samples within `window_s` and taken at the latest sample's replica count
    count: per-replica values from before a scale-up would ask for it again. A
    signal the latest sample lacks stays None (missing data).
    """
    latest = history[-1]
    same = [s for s in history
            if now - s.time <= window_s and s.replicas_reporting == latest.replicas_reporting]
    if len(same) <= 1:
        return latest.per_replica
    samples = [s.per_replica for s in same]
    out: dict[str, float | None] = {}
    for name, value in samples[-1].items():
        if value is None:
            out[name] = None
            continue
        seen = [x for v in samples if (x := v[name]) is not None]
        out[name] = sum(seen) / len(seen)
    return out


def _ceil(x: float) -> int:
    # Guards against 2.0000000001 becoming 3 after a division.
    return math.ceil(x - 1e-9)


def queue_utilization(queue: float) -> float:
    """Gives the utilisation an M/M/1 server has when `queue` requests wait on average.

    Inverts queue = ρ² / (1 − ρ). A queue is not proportional to load (it is near
    zero until a replica saturates), so scaling down on queue/target would halve
    a half-loaded pool and flap; the utilisation it implies is proportional.
    """
    return (math.sqrt(queue * queue + 4.0 * queue) - queue) / 2.0


def batch_utilization(running: float, knee: float) -> float:
    """Gives the fraction of its peak token rate a decode replica delivers at `running`.

    With a step time affine in the batch, step = c0 + c1·b, a replica's token rate
    is b / (c0 + c1·b) = (1/c1) · b / (b + knee) with knee = c0 / c1. Running
    requests therefore grow faster than load: halving the replicas of a pool at a
    third of its target batch more than doubles the batch.
    """
    return running / (running + knee)


def load_ratio(signal: str, value: float, target: float, knee: float) -> float:
    """Gives observed/target in units where load is proportional to replicas.

    Queue depth and running requests grow faster than load, so they vote by the
    utilisation they imply. A queue beyond twice its target means a saturated
    replica whose load the queue no longer tells: from there the ratio grows
    with the queue (continuously), so an overloaded pool scales fast.
    """
    ratio = value / target
    if signal == QUEUE_DEPTH:
        implied = queue_utilization(min(value, 2 * target)) / queue_utilization(target)
        return implied * max(1.0, value / (2 * target))
    if signal == RUNNING_REQUESTS and ratio < 1.0:
        return batch_utilization(value, knee) / batch_utilization(target, knee)
    return ratio


def vote(signal: str, value: float, target: float, replicas: int, tolerance: float,
         knee: float = 64.0, draining: bool = False) -> Vote | None:
    """Gives the signal's replica count: ceil(replicas × value / target) outside the tolerance.

    Inside the band the signal votes for `replicas` (no change). Below target
    queue depth and running requests vote by the utilisation they imply
    (`load_ratio`), and a scale-down aims at 1 − 1.5·tolerance of target, so the
    pool lands well inside the band. Latency signals and waiting prompt tokens
    only vote up: latency has a floor at the unloaded step time and a token
    backlog is near zero below saturation, so a low value says nothing about how
    many replicas could go; None means no opinion. A backlog above target that is
    `draining` (smaller than at the previous scrape) holds: the replicas there
    already serve more than arrives, and adding more for it overshoots.
    """
    ratio = load_ratio(signal, value, target, knee)
    if abs(ratio - 1.0) <= tolerance:
        return Vote(signal, value, target, replicas)
    if (signal in LATENCY_SIGNALS or signal == WAITING_PROMPT_TOKENS) and ratio < 1.0:
        return None
    if ratio < 1.0:
        # Land a tolerance below the band, not on the target: a pool sized to its
        # target (or to the band's edge) leaves the band on the next wobble and flaps,
        # which small pools, where one replica is a large step, do most.
        landing = max(1.0 - 1.5 * tolerance, 0.5)
        return Vote(signal, value, target, min(replicas, _ceil(replicas * ratio / landing)))
    if draining and signal in (QUEUE_DEPTH, WAITING_PROMPT_TOKENS):
        return Vote(signal, value, target, replicas)
    return Vote(signal, value, target, _ceil(replicas * ratio))
