"""Engine step wall times by how the step's forward ran, as histogram bucket counts."""

from __future__ import annotations

from bisect import bisect_left

from kvpilot.engine.contracts.metric_names import STEP_SECONDS_BUCKETS


class StepTimes:
    """Counts engine steps per forward mode ("graph", "piecewise", "eager") in the buckets
    of STEP_SECONDS_BUCKETS (then +Inf), and sums their seconds: what /metrics exports as
    kvpilot_engine_step_seconds."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, mode: str, seconds: float) -> None:
        counts = self.counts.get(mode)
        if counts is None:
            counts = self.counts[mode] = [0] * (len(STEP_SECONDS_BUCKETS) + 1)
            self.sums[mode] = 0.0
        # a bucket holds the steps up to and including its bound (Prometheus' `le`)
        counts[bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self.sums[mode] += seconds
