"""The pool's latency as a few linear terms times each replica's speed, learnt online.

TTFT (seconds to the first streamed byte, through the router) on replica r is modelled as

    speed_r * (base + per_prefill_token * (prompt tokens of the requests on r still
                                           prefilling + this prompt's tokens less its hit)
                    + per_decoding * (requests on r already streaming))

and TPOT (seconds between streamed events) as `speed_r * (base + per_decoding * batch +
per_context_token * context)`, with a speed of its own per target.

One fit for the whole pool: its replicas run the same engine and model, so every request
teaches all of them the shape (what a token or a streaming request costs), where a fit per
replica learnt from half the samples and carried intercepts that differed by ~0.15 s on
identical replicas, a bias that sent requests to one side (decision 0110). What does
differ between replicas, how fast each runs now (its host's other load, its core), is one
multiplier per replica: each observation moves its log a step `SPEED_STEP` towards the
observed/predicted ratio, and the speeds are renormalised to a geometric mean of 1 (the
fit absorbs the scale), so a coefficient still reads as seconds on a typical replica.

One coefficient for the queued tokens and the request's own: the engine prefills first in,
first out under a token budget, so a token ahead costs what one of the request's own does.
Two coefficients (as first built) were confounded on real traffic: the queued term and the
decoding term each soaked up the other's load.

Each fit is recursive least squares with a forgetting factor (recent requests count more);
the coefficients and speeds are exported (`kvpilot_router_latency_model_coefficient`,
`kvpilot_router_latency_model_speed`). The model is cold until the pool has seen
`min_samples` requests and each candidate at least one; placement falls back to the
configured policy until then.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

TTFT_TERMS = ("base", "prefill_tokens", "decoding")
TPOT_TERMS = ("base", "decoding", "context_tokens")
# Features go in thousands of tokens, so every term's coefficient lands within a few
# orders of magnitude of the others and the fit's prior treats them alike.
TOKEN_SCALE = 1000.0
FORGET = 0.995  # a sample's weight halves after ~140 newer ones
PRIOR = 100.0  # initial covariance: weak, the first samples decide
# A replica's speed moves a fifth of the way (in log) to each sample's observed/predicted
# ratio: a few requests follow a replica that slows down, one outlier moves it little.
SPEED_STEP = 0.2
SPEED_RANGE = (0.1, 10.0)  # how much faster or slower than the pool a replica may be


@dataclass
class OnlineLinear:
    """A linear model `y = w . x` fitted by recursive least squares with forgetting."""

    terms: tuple[str, ...]
    forget: float = FORGET
    weights: np.ndarray = field(init=False)
    covariance: np.ndarray = field(init=False)
    samples: int = 0

    def __post_init__(self) -> None:
        self.weights = np.zeros(len(self.terms))
        self.covariance = np.eye(len(self.terms)) * PRIOR

    def predict(self, x: np.ndarray) -> float:
        """Gives the model's value at `x`, never below zero (a latency)."""
        return max(0.0, float(self.weights @ x))

    def update(self, x: np.ndarray, y: float) -> None:
        """Moves the fit towards the observation `y` at `x`."""
        px = self.covariance @ x
        gain = px / (self.forget + x @ px)
        self.weights = self.weights + gain * (y - self.weights @ x)
        covariance = (self.covariance - np.outer(gain, px)) / self.forget
        # Forgetting inflates the covariance of terms the recent requests did not vary (a
        # replica idle for a while has no queued tokens): bound each term's to the prior, so
        # one later request varying it cannot swing the fit.
        scale = np.sqrt(np.minimum(1.0, PRIOR / np.maximum(np.diag(covariance), 1e-12)))
        self.covariance = covariance * np.outer(scale, scale)
        self.samples += 1

    def coefficients(self) -> dict[str, float]:
        """Gives each term's coefficient (per 1,000 tokens for token terms)."""
        return dict(zip(self.terms, (float(w) for w in self.weights), strict=True))


def moved_speed(speed: float, observed: float, predicted: float) -> float:
    """Gives a replica's speed after one sample: its log a `SPEED_STEP` of the way to the
    sample's ratio of observed to predicted (the pool's prediction times `speed`)."""
    if predicted <= 0 or observed <= 0:
        return speed
    low, high = SPEED_RANGE
    ratio = min(max(observed / (speed * predicted), low), high)
    return min(max(speed * ratio ** SPEED_STEP, low), high)


@dataclass(frozen=True)
class TtftFeatures:
    """What a request's TTFT on one replica depends on, as the router knows it."""

    new_prompt_tokens: float  # the prompt less the blocks the replica probably caches
    queued_prefill_tokens: float  # new prompt tokens of its requests not streaming yet
    decoding: int  # its requests already streaming

    def vector(self) -> np.ndarray:
        prefill = self.new_prompt_tokens + self.queued_prefill_tokens
        return np.array([1.0, prefill / TOKEN_SCALE, float(self.decoding)])


@dataclass(frozen=True)
class TpotFeatures:
    """What the time between a stream's events depends on."""

    decoding: int  # the replica's streaming requests (the decode batch, as the router sees it)
    context_tokens: float  # the request's prompt plus half its output

    def vector(self) -> np.ndarray:
        return np.array([1.0, float(self.decoding), self.context_tokens / TOKEN_SCALE])


@dataclass
class ReplicaSpeed:
    """How much slower than the pool's fit one replica runs now, per target (1: typical)."""

    ttft: float = 1.0
    tpot: float = 1.0
    samples: int = 0  # TTFT samples from this replica


@dataclass
class PoolModel:
    """The pool's TTFT and TPOT fits and each replica's speeds."""

    ttft: OnlineLinear = field(default_factory=lambda: OnlineLinear(TTFT_TERMS))
    tpot: OnlineLinear = field(default_factory=lambda: OnlineLinear(TPOT_TERMS))
    speeds: dict[str, ReplicaSpeed] = field(default_factory=dict)

    def speed(self, url: str) -> ReplicaSpeed:
        return self.speeds.setdefault(url, ReplicaSpeed())

    def warm(self, min_samples: int, urls: Iterable[str]) -> bool:
        """Gives whether the pool has `min_samples` TTFT samples and each of `urls` one."""
        return self.ttft.samples >= min_samples and all(
            self.speed(url).samples > 0 for url in urls)

    def predict_ttft(self, url: str, features: TtftFeatures) -> float:
        return self.speed(url).ttft * self.ttft.predict(features.vector())

    def predict_tpot(self, url: str, features: TpotFeatures) -> float | None:
        """Gives the predicted TPOT, None while the TPOT fit has seen nothing."""
        if not self.tpot.samples:
            return None
        return self.speed(url).tpot * self.tpot.predict(features.vector())

    def observe_ttft(self, url: str, features: TtftFeatures, ttft: float) -> None:
        """Learns from one TTFT observed on `url`: the pool's fit from it at that replica's
        speed, then the replica's speed."""
        speed, x = self.speed(url), features.vector()
        predicted = self.ttft.predict(x)
        self.ttft.update(x, ttft / speed.ttft)
        speed.ttft = moved_speed(speed.ttft, ttft, predicted)
        speed.samples += 1
        self._renormalise("ttft", self.ttft)

    def observe_tpot(self, url: str, features: TpotFeatures, tpot: float) -> None:
        """Learns from one stream's mean time between events on `url`."""
        speed, x = self.speed(url), features.vector()
        predicted = self.tpot.predict(x)
        self.tpot.update(x, tpot / speed.tpot)
        speed.tpot = moved_speed(speed.tpot, tpot, predicted)
        self._renormalise("tpot", self.tpot)

    def forget(self, url: str) -> None:
        self.speeds.pop(url, None)

    def _renormalise(self, target: str, fit: OnlineLinear) -> None:
        """Scales the speeds to a geometric mean of 1 and the fit by as much (predictions
        unchanged), so that neither drifts against the other."""
        speeds = [getattr(s, target) for s in self.speeds.values()]
        mean = math.exp(sum(math.log(v) for v in speeds) / len(speeds))
        for s in self.speeds.values():
            setattr(s, target, getattr(s, target) / mean)
        fit.weights = fit.weights * mean
