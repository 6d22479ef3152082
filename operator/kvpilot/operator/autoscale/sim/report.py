"""What a simulation run means: SLO attainment, GPU-hours, scale events, flapping."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from kvpilot.operator.autoscale.sim.calibration import CostModel
from kvpilot.operator.autoscale.sim.fleet import SimTrace, Workload

TAIL_S = 60.0  # requests arriving this close to the end may still be in flight


@dataclass(frozen=True)
class SimReport:
    """One run in numbers."""

    requests: float
    slo_attainment: float
    """Fraction of requests with TTFT and ITL within the workload's SLO."""
    gpu_hours: float
    scale_events: int
    max_direction_changes_per_5min: int
    """The most up/down reversals of any one pool inside any 300 s."""
    peak_replicas: dict[str, int]
    """Most replicas the fleet held at once, by pool role (prefill and decode, or both)."""

    def to_json(self) -> dict[str, object]:
        """Gives the report as a JSON-ready dict."""
        return asdict(self)


def slo_met(trace: SimTrace, workload: Workload) -> np.ndarray:
    """Gives, per tick and model, the expected fraction of that tick's arrivals within SLO.

    Requests leave in arrival order (fluid FIFO), so a tick's arrivals reach decode
    when the admitted count passes their cumulative position; on top of that wait,
    prefill takes an exponential M/M/1 sojourn of the mean the run recorded.
    Arrivals never admitted (except in the last minute) count as missed.
    """
    dt = trace.tick_s
    ticks, models = trace.arrivals.shape
    out = np.zeros((ticks, models))
    arrival_time = (np.arange(ticks) + 0.5) * dt
    for m in range(models):
        arrivals = trace.arrivals[:, m]
        position = np.cumsum(arrivals) - arrivals / 2
        admitted = trace.admitted_cum[:, m]
        j = np.searchsorted(admitted, position - 1e-9, side="left")
        done = j < ticks
        jj = np.minimum(j, ticks - 1)
        prev = np.where(jj > 0, admitted[np.maximum(jj - 1, 0)], 0.0)
        step = np.maximum(admitted[jj] - prev, 1e-12)
        crossing = (jj + np.clip((position - prev) / step, 0.0, 1.0)) * dt
        itl = trace.itl_s[jj, m]
        wait = np.maximum(crossing - arrival_time, 0.0) + itl
        mean = trace.prefill_sojourn_s[:, m]
        slack = workload.ttft_slo_s - wait
        met = np.where(slack > 0, 1.0 - np.exp(-np.maximum(slack, 0.0) / mean), 0.0)
        met *= itl <= workload.itl_slo_s
        out[:, m] = np.where(done, met, np.where(arrival_time > ticks * dt - TAIL_S, np.nan, 0.0))
    return out


def direction_changes(events: list[tuple[float, int, int, int, int, str]],
                      window_s: float = 300.0) -> int:
    """Gives the most direction reversals any one pool made inside any `window_s`."""
    per_pool: dict[tuple[int, int], list[tuple[float, int]]] = defaultdict(list)
    for time, model, pool, old, new, _ in events:
        per_pool[(model, pool)].append((time, 1 if new > old else -1))
    worst = 0
    for moves in per_pool.values():
        flips = [t for (t, d), (_, prev) in zip(moves[1:], moves[:-1], strict=True) if d != prev]
        for k, start in enumerate(flips):
            inside = sum(1 for t in flips[k:] if t - start < window_s)
            worst = max(worst, inside)
    return worst


def first_scale_up_after(events: list[tuple[float, int, int, int, int, str]],
                         time_s: float) -> float | None:
    """Gives seconds from `time_s` to the first scale-up decision after it (None: none)."""
    ups = [t for t, _, _, old, new, _ in events if new > old and t >= time_s]
    return min(ups) - time_s if ups else None


def summarize(trace: SimTrace, workload: Workload, cost: CostModel) -> SimReport:
    """Gives the run's report."""
    met = slo_met(trace, workload)
    counted = ~np.isnan(met)
    weights = np.where(counted, trace.arrivals, 0.0)
    total = float(weights.sum())
    attained = float(np.nansum(met * weights) / total) if total else 1.0
    gpu_hours = float(trace.replicas.sum()) * trace.gpus_per_replica * trace.tick_s / 3600
    peak = trace.replicas.max(axis=0)
    return SimReport(requests=float(trace.arrivals.sum()), slo_attainment=attained,
                     gpu_hours=gpu_hours, scale_events=len(trace.events),
                     max_direction_changes_per_5min=direction_changes(trace.events),
                     peak_replicas={role: int(peak[column]) for role, column in trace.pools()})
