"""Predicted-latency placement: the online models learn known costs, the choice table, one
request's trip through a replica's load, and the policy in the router app."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from router_fake_engine import FakeEngine

from kvpilot.engine.router.flow_control import Admission
from kvpilot.engine.router.flow_ticket import FlowTicket
from kvpilot.engine.router.latency_model import (
    TTFT_TERMS,
    OnlineLinear,
    PoolModel,
    TtftFeatures,
)
from kvpilot.engine.router.latency_placement import Prediction, choose_predicted
from kvpilot.engine.router.latency_tracker import LatencyModels, RequestLatency

A, B, C = "http://a", "http://b", "http://c"


@pytest.mark.parametrize("truth", [
    (0.02, 0.5, 0.01),  # 20 ms base, 0.5 s per 1k tokens to prefill, 10 ms per streaming one
    (0.1, 2.0, 0.05),
    (0.0, 0.1, 0.0),
])
def test_ttft_model_learns_known_costs(truth):
    rng = np.random.default_rng(0)
    fit = OnlineLinear(TTFT_TERMS)
    for _ in range(200):
        x = TtftFeatures(rng.uniform(0, 3000), rng.uniform(0, 5000), int(rng.integers(0, 16)))
        fit.update(x.vector(), float(np.dot(truth, x.vector())))
    assert fit.samples == 200
    assert list(fit.coefficients().values()) == pytest.approx(truth, abs=1e-3)


def test_a_queued_token_costs_what_an_own_token_does():
    """The engine prefills first in, first out: a short prompt behind a long one waits for
    all of it. Learnt from requests alone on the replica, the model predicts that wait."""
    fit = OnlineLinear(TTFT_TERMS)
    rng = np.random.default_rng(2)
    for _ in range(100):
        x = TtftFeatures(rng.uniform(0, 2000), 0.0, 0).vector()
        fit.update(x, 0.01 + 0.4 * x[1])
    model = PoolModel(ttft=fit)
    behind_a_document = model.predict_ttft(A, TtftFeatures(50, 1500, 0))
    assert behind_a_document == pytest.approx(0.01 + 0.4 * 1.55, rel=0.01)
    assert behind_a_document > 10 * model.predict_ttft(A, TtftFeatures(50, 0, 0))


def test_ttft_model_follows_a_replica_that_slows_down():
    fit = OnlineLinear(TTFT_TERMS)
    rng = np.random.default_rng(1)
    for per_token, n in ((0.5, 600), (2.0, 1500)):  # then the replica gets 4x slower per token
        for _ in range(n):
            x = TtftFeatures(rng.uniform(0, 2000), 0.0, 0).vector()
            fit.update(x, 0.01 + per_token * x[1])
    assert fit.coefficients()["prefill_tokens"] == pytest.approx(2.0, rel=0.01)
    # the terms those requests never varied kept a bounded covariance
    assert np.diag(fit.covariance).max() <= 100.0 + 1e-9


def test_a_model_is_cold_until_min_samples_and_each_replica_one_and_never_below_zero():
    model = PoolModel()
    assert not model.warm(1, [A]) and model.warm(0, [])
    model.observe_ttft(A, TtftFeatures(1000, 0, 0), 0.5)
    assert model.warm(1, [A]) and not model.warm(1, [A, B]) and not model.warm(2, [A])
    model.ttft.weights = np.array([-5.0, 0.0, 0.0])
    assert model.predict_ttft(A, TtftFeatures(1000, 0, 0)) == 0.0


def _pool_samples(model: PoolModel, rng: np.random.Generator, slowness: dict[str, float],
                  n: int) -> None:
    """Feeds `model` n requests per replica of a pool whose replicas share one cost shape
    (20 ms + 0.4 s per 1k tokens to prefill + 30 ms per streaming request) at speeds
    `slowness`, with 10% noise."""
    for _ in range(n):
        for url, slow in slowness.items():
            x = TtftFeatures(rng.uniform(0, 2000), rng.uniform(0, 1500), int(rng.integers(0, 8)))
            truth = slow * float(np.dot((0.02, 0.4, 0.03), x.vector()))
            model.observe_ttft(url, x, truth * rng.uniform(0.9, 1.1))


def test_the_pool_learns_its_shape_and_each_replica_its_speed():
    """Two replicas, one 3x slower now: one fit of the shape from both, a speed each, the
    speeds' geometric mean 1 (so the coefficients read on a typical replica)."""
    model = PoolModel()
    _pool_samples(model, np.random.default_rng(3), {A: 1.0, B: 3.0}, 150)
    assert model.speed(B).ttft / model.speed(A).ttft == pytest.approx(3.0, rel=0.1)
    assert model.speed(A).ttft * model.speed(B).ttft == pytest.approx(1.0, rel=1e-6)
    x = TtftFeatures(800, 400, 2)
    for url, slow in ((A, 1.0), (B, 3.0)):
        truth = slow * float(np.dot((0.02, 0.4, 0.03), x.vector()))
        assert model.predict_ttft(url, x) == pytest.approx(truth, rel=0.1)


def test_a_replica_that_slows_down_is_followed_within_a_few_requests():
    """Its speed moves, not the pool's shape: 15 requests after B gets 2x slower the model
    predicts it within 15%, while A's predictions stay where they were."""
    model = PoolModel()
    rng = np.random.default_rng(4)
    _pool_samples(model, rng, {A: 1.0, B: 1.0}, 100)
    x = TtftFeatures(800, 400, 2)
    before_a = model.predict_ttft(A, x)
    _pool_samples(model, rng, {A: 1.0, B: 2.0}, 15)
    assert model.predict_ttft(B, x) == pytest.approx(2 * before_a, rel=0.15)
    assert model.predict_ttft(A, x) == pytest.approx(before_a, rel=0.1)


@pytest.mark.parametrize(("predictions", "ttft_slo", "tpot_slo", "counter", "url", "meets"), [
    # no objective: the lowest predicted TTFT
    ([Prediction(A, 0.5), Prediction(B, 0.2), Prediction(C, 0.9)], None, None, 0, B, True),
    # an objective some meet: still the lowest TTFT among those
    ([Prediction(A, 0.5), Prediction(B, 0.2)], 0.3, None, 0, B, True),
    # the TPOT objective rules B out although its TTFT is lowest
    ([Prediction(A, 0.5, 0.02), Prediction(B, 0.2, 0.09)], 1.0, 0.05, 0, A, True),
    # a replica whose TPOT model has no data yet is not ruled out by it
    ([Prediction(A, 0.5, 0.02), Prediction(B, 0.2, None)], 1.0, 0.05, 0, B, True),
    # nobody meets it: the lowest TTFT, flagged
    ([Prediction(A, 0.5), Prediction(B, 0.4)], 0.1, None, 0, B, False),
    # ties rotate with the counter
    ([Prediction(A, 0.3), Prediction(B, 0.3)], None, None, 0, A, True),
    ([Prediction(A, 0.3), Prediction(B, 0.3)], None, None, 1, B, True),
])
def test_choose_predicted(predictions, ttft_slo, tpot_slo, counter, url, meets):
    choice = choose_predicted(predictions, ttft_slo, tpot_slo, counter)
    assert (choice.prediction.url, choice.meets) == (url, meets)


def test_choose_predicted_needs_a_candidate():
    with pytest.raises(ValueError, match="no instance"):
        choose_predicted([])


async def test_a_trip_adds_its_load_and_gives_back_samples():
    models = LatencyModels(min_samples=1, registry=CollectorRegistry())
    trip = RequestLatency(models, FlowTicket(ttft_slo_s=10.0), prompt_tokens=1000,
                          output_tokens=4, stream=True, admission=Admission())
    trip.started(A, 800, None)
    assert models.state(A).prefilling_tokens == 800
    trip.started(B, 600, Prediction(B, 0.25))  # A failed before its first byte: retried on B
    assert (models.state(A).prefilling_tokens, models.state(B).prefilling_tokens) == (0, 600)

    async def events():
        for _ in range(3):
            await asyncio.sleep(0.01)
            yield b"data: {}\n\n"
        yield b"data: [DONE]\n\n"

    response = trip.finish(StreamingResponse(events(), media_type="text/event-stream"))
    assert response.headers["x-kvpilot-predicted-ttft-ms"] == "250.0"
    state = models.state(B)
    assert (state.prefilling_tokens, state.decoding, models.model.ttft.samples) == (0, 1, 1)
    assert models.model.speed(B).samples == 1 and models.model.speed(A).samples == 0
    assert [c async for c in response.body_iterator][-1] == b"data: [DONE]\n\n"
    assert state.decoding == 0 and models.model.tpot.samples == 1
    assert models.warm([B]) and not models.warm([A, B])
    assert models.slo.labels("met")._value.get() == 1


async def test_a_failed_trip_gives_back_its_load_and_no_sample():
    models = LatencyModels(min_samples=1, registry=CollectorRegistry())
    trip = RequestLatency(models, FlowTicket(), 500, 4, True, Admission())
    trip.started(A, 500, None)
    trip.finish(JSONResponse({"error": {}}, 502))
    state = models.state(A)
    assert (state.prefilling_tokens, state.decoding, models.model.ttft.samples) == (0, 0, 0)


async def test_router_places_by_predicted_latency_once_warm(fleet):
    """Two replicas, one 10x slower to its first token: while cold the configured fallback
    spreads requests; once the pool's model is warm and each replica has answered once, new
    requests go to the fast one, and the response says what was predicted."""
    fast = FakeEngine("fast", chunks=2, first_delay=0.01)
    slow = FakeEngine("slow", chunks=2, first_delay=0.1)
    router, urls = await fleet([fast, slow], policy="predicted-latency", latency_min_samples=3)
    body = {"model": "tiny", "prompt": "hello", "stream": True}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(40):  # round-robin-like spreading until both are warm
            response = await client.post(f"{router}/v1/completions", json=body)
            assert response.status_code == 200
            if "x-kvpilot-predicted-ttft-ms" in response.headers:
                break
        assert "x-kvpilot-predicted-ttft-ms" in response.headers
        served = [(await client.post(f"{router}/v1/completions", json=body))
                  .headers["x-kvpilot-served-by"] for _ in range(6)]
        metrics = (await client.get(f"{router}/metrics")).text
    assert len(slow.bodies) >= 1  # it was tried while cold
    assert served == [urls["fast"]] * 6
    assert "kvpilot_router_latency_model_coefficient" in metrics
