"""Each replica's latency as a few linear terms, learnt online from the requests it served.

TTFT (seconds to the first streamed byte, through the router) is modelled as

    base + per_prefill_token * (prompt tokens of the requests on the replica still
                                prefilling + this prompt's tokens less its prefix hit)
         + per_decoding * (requests on the replica already streaming)

One coefficient for the queued tokens and the request's own: the engine prefills first in,
first out under a token budget, so a token ahead costs what one of the request's own does.
Two coefficients (as first built) were confounded on real traffic: the queued term and the
decoding term each soaked up the other's load (decision 0110).

and TPOT (seconds between streamed events) as `base + per_decoding * batch +
per_context_token * context`. Each is a recursive least-squares fit with a forgetting
factor (recent requests count more: a replica's speed drifts with its cache and its
neighbours), so a coefficient reads as what one more token or one more request costs on
that replica; they are exported as `kvpilot_router_latency_model_coefficient`. A model is
cold until it has seen `min_samples` requests; placement falls back to the configured
policy until every candidate's model is warm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TTFT_TERMS = ("base", "prefill_tokens", "decoding")
TPOT_TERMS = ("base", "decoding", "context_tokens")
# Features go in thousands of tokens, so every term's coefficient lands within a few
# orders of magnitude of the others and the fit's prior treats them alike.
TOKEN_SCALE = 1000.0
FORGET = 0.995  # a sample's weight halves after ~140 newer ones
PRIOR = 100.0  # initial covariance: weak, the first samples decide


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
class ReplicaModel:
    """One replica's TTFT and TPOT models."""

    ttft: OnlineLinear = field(default_factory=lambda: OnlineLinear(TTFT_TERMS))
    tpot: OnlineLinear = field(default_factory=lambda: OnlineLinear(TPOT_TERMS))

    def warm(self, min_samples: int) -> bool:
        return self.ttft.samples >= min_samples

    def predict_ttft(self, features: TtftFeatures) -> float:
        return self.ttft.predict(features.vector())

    def predict_tpot(self, features: TpotFeatures) -> float | None:
        """Gives the predicted TPOT, None while the TPOT model has seen nothing."""
        return self.tpot.predict(features.vector()) if self.tpot.samples else None
