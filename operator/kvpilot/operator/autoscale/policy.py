"""The autoscaling decision for one pool: a pure function of metrics, state, spec and clock.

Per signal the desired count is ceil(replicas × observed / target) outside a
tolerance band; the largest wins. A recommendation history gives the two
stabilisation windows (HPA's rule: scale up to the lowest recommendation of the
up window, down to the highest of the down window), changes in the last period
give the rate limits, and min/max bound the result. Missing, stale or partial
metrics may hold or raise a pool, never shrink it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpilot.operator.autoscale.signals import (
    PoolMetrics,
    Vote,
    smoothed_values,
    vote,
)
from kvpilot.operator.autoscale.spec import LATENCY_SIGNALS, PolicySpec


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between decisions of one pool."""

    since: float | None = None
    """When the policy first saw the pool; scale-down waits a full window after it."""
    recommendations: tuple[tuple[float, int], ...] = ()
    """(time, replicas) recommended at each decision inside the longest window."""
    changes: tuple[tuple[float, int], ...] = ()
    """(time, signed replica change) applied inside the longest rate-limit period."""


@dataclass(frozen=True)
class Decision:
    """The policy's answer: the replicas to set and why."""

    time: float
    current: int
    desired: int
    recommendation: int
    """The signals' count within bounds, before windows and rate limits."""
    vote: Vote | None
    """The winning signal (None when no signal could vote)."""
    reason: str
    held_by: tuple[str, ...] = ()
    """What kept `desired` from `recommendation`: window, rate limit, missing data, bounds."""
    votes: tuple[Vote, ...] = ()
    state: PolicyState = field(default_factory=PolicyState)


def _clamp(n: int, spec: PolicySpec) -> int:
    return max(spec.min_replicas, min(spec.max_replicas, n))


def _missing(metrics: PoolMetrics | None, spec: PolicySpec, current: int,
             now: float) -> str | None:
    """Gives why the metrics cannot justify a scale-down (None when they can)."""
    if current == 0:
        return None  # no pod to scrape: the router's demand is the only signal
    if metrics is None:
        return "no metrics"
    age = now - metrics.time
    if age > spec.max_metrics_age_seconds:
        return f"metrics {age:.0f}s old (max {spec.max_metrics_age_seconds:.0f}s)"
    if metrics.replicas_reporting < current:
        return f"{metrics.replicas_reporting}/{current} replicas reported metrics"
    values = metrics.per_replica
    # Latency signals only ever vote up, so an idle pool without latency samples
    # (no requests, no histogram observations) is not missing anything.
    absent = [s for s in spec.targets if values[s] is None and s not in LATENCY_SIGNALS]
    if absent:
        return f"no value for {', '.join(absent)}"
    return None


def _votes(history: Sequence[PoolMetrics], spec: PolicySpec, now: float) -> list[Vote]:
    if not history or now - history[-1].time > spec.max_metrics_age_seconds:
        return []
    metrics = history[-1]
    values = smoothed_values(history, spec.metrics_window_seconds, now)
    draining = _draining(history)
    out = []
    for signal, target in spec.targets.items():
        value = values[signal]
        if value is None or metrics.replicas_reporting == 0:
            continue
        v = vote(signal, value, target, metrics.replicas_reporting, spec.tolerance,
                 spec.running_knee, draining)
        if v is not None:
            out.append(v)
    return out


def _draining(history: Sequence[PoolMetrics]) -> bool:
    """Gives whether the pool's waiting requests shrank since the previous scrape."""
    if len(history) < 2:
        return False
    now, before = history[-1].requests_waiting, history[-2].requests_waiting
    return now is not None and before is not None and now < before


def startup_window(spec: PolicySpec, metrics: PoolMetrics | None) -> float:
    """Gives how long a scale-up's pods may take to report: `pod_startup_seconds`, or the
    longest start-up the pool's engines reported (loading, CUDA graphs and the warm-up)
    when that is longer."""
    reported = metrics.startup_seconds if metrics is not None else None
    return max(spec.pod_startup_seconds, reported or 0.0)


def _starting(metrics: PoolMetrics | None, state: PolicyState, current: int, now: float,
              spec: PolicySpec) -> str | None:
    """Gives why a scale-up waits for the pods of the previous one (None: it need not)."""
    if metrics is None or metrics.replicas_reporting >= current:
        return None
    window = startup_window(spec, metrics)
    recent_up = [t for t, d in state.changes if d > 0 and now - t < window]
    if not recent_up:
        return None
    return (f"waiting for started pods ({metrics.replicas_reporting}/{current} report, "
            f"up to {window:.0f}s)")


def _rate_limit(desired: int, current: int, spec: PolicySpec, changes: tuple[tuple[float, int], ...],
                now: float) -> int:
    """Gives `desired` cut to what the period's rate limit still allows."""
    if desired > current:
        rules = spec.scale_up
        added = sum(d for t, d in changes if d > 0 and now - t < rules.period_seconds)
        return min(desired, current - added + rules.max_replicas_per_period)
    rules = spec.scale_down
    removed = sum(-d for t, d in changes if d < 0 and now - t < rules.period_seconds)
    return max(desired, current + removed - rules.max_replicas_per_period)


def _windows(history: tuple[tuple[float, int], ...], recommendation: int, spec: PolicySpec,
             now: float) -> tuple[int, int, list[tuple[float, int]]]:
    """Gives the lowest recommendation of the up window, the highest of the down window
    (both counting this one), and the history still inside the longer window."""
    up_window = spec.scale_up.stabilization_window_seconds
    down_window = spec.scale_down.stabilization_window_seconds
    horizon = max(up_window, down_window)
    kept: list[tuple[float, int]] = []
    up_to = down_to = recommendation
    for t, r in history:
        age = now - t
        if age >= horizon:
            continue
        kept.append((t, r))
        if age <= up_window and r < up_to:
            up_to = r
        if age <= down_window and r > down_to:
            down_to = r
    kept.append((now, recommendation))
    return up_to, down_to, kept


def _describe(v: Vote | None) -> str:
    if v is None:
        return "no signal"
    return f"{v.signal} {v.value:.3g} vs target {v.target:.3g}"


def decide(spec: PolicySpec, state: PolicyState, history: Sequence[PoolMetrics], current: int,
           now: float) -> Decision:
    """Gives the replicas the pool should have now, with the reason and the next state.

    `history` holds the pool's recent samples, oldest first; the latest decides
    whether data is missing, the ones within `metrics_window_seconds` are averaged.
    """
    since = now if state.since is None else state.since
    held: list[str] = []
    metrics = history[-1] if history else None
    votes = _votes(history, spec, now)
    best = max(votes, key=lambda v: (v.replicas, v.value / v.target), default=None)
    missing = _missing(metrics, spec, current, now)
    demand = metrics.demand if metrics is not None and now - metrics.time <= \
        spec.max_metrics_age_seconds else 0

    raw = best.replicas if best is not None else current
    reason = _describe(best)
    starting = _starting(metrics, state, current, now, spec)
    if starting and raw > current:
        raw = current
        held.append(starting)
    if demand > 0 and raw < 1:
        raw, reason = 1, f"router holds {demand} requests for a pool with no ready replica"
    if missing is not None and (raw < current or not votes):
        raw = max(raw, current)
        held.append(f"missing data ({missing})")
    recommendation = _clamp(raw, spec)

    up_window = spec.scale_up.stabilization_window_seconds
    down_window = spec.scale_down.stabilization_window_seconds
    up_to, down_to, kept = _windows(state.recommendations, recommendation, spec, now)
    # After a restart the history is empty: a scale-down needs a full window of it.
    if now - since < down_window:
        down_to = max(down_to, current)

    desired = current
    if up_to > current:
        desired = up_to
    elif down_to < current:
        desired = down_to
    if recommendation > current and desired < recommendation:
        held.append(f"scale-up window {up_window:.0f}s")
    elif recommendation < current and desired > recommendation:
        held.append(f"scale-down window {down_window:.0f}s")

    limited = _rate_limit(desired, current, spec, state.changes, now) \
        if desired != current else desired
    if limited != desired:
        rules = spec.scale_up if desired > current else spec.scale_down
        held.append(f"rate limit {rules.max_replicas_per_period} per "
                    f"{rules.period_seconds:.0f}s")
    bounded = _clamp(limited, spec)
    if bounded != limited:
        held.append("minReplicas" if bounded > limited else "maxReplicas")
    if raw != recommendation:
        held.append("maxReplicas" if raw > recommendation else "minReplicas")

    period = max(spec.scale_up.period_seconds, spec.scale_down.period_seconds,
                 startup_window(spec, metrics))
    changes = tuple((t, d) for t, d in state.changes if now - t < period)
    if bounded != current:
        changes += ((now, bounded - current),)
    next_state = PolicyState(since=since, recommendations=tuple(kept), changes=changes)
    return Decision(time=now, current=current, desired=bounded, recommendation=recommendation,
                    vote=best, reason=reason, held_by=tuple(dict.fromkeys(held)),
                    votes=tuple(votes), state=next_state)

