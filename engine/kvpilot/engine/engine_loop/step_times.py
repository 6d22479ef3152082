"""The engine's per-step histograms as bucket counts: step wall times by how the step's forward
ran, and tokens per step."""

from __future__ import annotations

from bisect import bisect_left

from kvpilot.engine.contracts.metric_names import ITERATION_TOKENS_BUCKETS, STEP_SECONDS_BUCKETS


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


class StepTokens:
    """Counts engine steps by their prompt tokens computed plus tokens generated, in the
    buckets of ITERATION_TOKENS_BUCKETS (then +Inf), and sums the tokens: what /metrics
    exports as vllm:iteration_tokens_total. Under async scheduling a step computes one
    batch's prompt tokens and reads back the previous batch's generated ones."""

    def __init__(self) -> None:
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.sum = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1
        self.sum += tokens
