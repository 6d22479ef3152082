"""Predicted-latency placement as a pure choice over each candidate's predictions.

A candidate meets a request's objectives when its predicted TTFT is within the TTFT
objective and its predicted TPOT (when its TPOT model has data) within the TPOT one. The
request goes to the candidate with the lowest predicted TTFT among those that meet them
(the most headroom), else among all (then `meets` is False: flow control queues or sheds
such a request before it gets here, `--slo-unmeetable`). Ties rotate with `counter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    """What the models predict for the request on one replica."""

    url: str
    ttft_s: float
    tpot_s: float | None = None


@dataclass(frozen=True)
class Choice:
    """The replica chosen, its prediction, and whether it meets the objectives."""

    prediction: Prediction
    meets: bool


def meets(p: Prediction, ttft_slo_s: float | None, tpot_slo_s: float | None) -> bool:
    """Gives whether the prediction meets the objectives (an absent one always does)."""
    return ((ttft_slo_s is None or p.ttft_s <= ttft_slo_s)
            and (tpot_slo_s is None or p.tpot_s is None or p.tpot_s <= tpot_slo_s))


def choose_predicted(predictions: Sequence[Prediction], ttft_slo_s: float | None = None,
                     tpot_slo_s: float | None = None, counter: int = 0) -> Choice:
    """Gives the candidate with the lowest predicted TTFT among those meeting the objectives,
    else among all."""
    if not predictions:
        raise ValueError("no instance to choose from")
    n = len(predictions)
    rotated = [predictions[(counter + i) % n] for i in range(n)]
    meeting = [p for p in rotated if meets(p, ttft_slo_s, tpot_slo_s)]
    best = min(meeting or rotated, key=lambda p: p.ttft_s)
    return Choice(best, bool(meeting))
