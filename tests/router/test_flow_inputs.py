"""Flow control's inputs as tables: saturation and headroom, a request's ticket from its
headers and model, and the `--objectives` contract."""

from __future__ import annotations

import pytest

from kvpilot.engine.contracts.router_objectives import (
    Objective,
    objectives_json,
    parse_objectives,
)
from kvpilot.engine.router.flow_ticket import BadFlowHeader, FlowTicket, classify
from kvpilot.engine.router.saturation import (
    LoadView,
    SaturationLimits,
    headroom,
    pool_headroom,
    queue_estimate,
)

A, B = "http://a", "http://b"


@pytest.mark.parametrize(("view", "estimate", "room"), [
    (LoadView(A), 0.0, 2),  # idle: takes queue_depth more
    (LoadView(A, waiting=1), 1.0, 1),
    # sent 3 since the scrape (in flight 5, 2 then): the engine queue grew by 3
    (LoadView(A, waiting=0, in_flight=5, in_flight_at_scrape=2), 3.0, 0),
    # 2 of what was in flight at the scrape finished: 2 of the queue started
    (LoadView(A, waiting=3, in_flight=4, in_flight_at_scrape=6), 1.0, 1),
    (LoadView(A, waiting=0, in_flight=0, in_flight_at_scrape=6), 0.0, 2),
    (LoadView(A, kv_usage=0.95), 0.0, 0),  # KV pressure saturates whatever the queue
    (LoadView(A, waiting=0.5), 0.5, 2),
])
def test_replica_headroom(view, estimate, room):
    limits = SaturationLimits(queue_depth=2, kv_usage=0.95)
    assert queue_estimate(view) == estimate
    assert headroom(view, limits) == room


@pytest.mark.parametrize(("views", "room"), [
    ([], None),  # nothing ready: not flow control's call
    ([LoadView(A, waiting=2), LoadView(B, kv_usage=1.0)], 0),
    ([LoadView(A, waiting=2), LoadView(B, waiting=1)], 1),
    ([LoadView(A), LoadView(B)], 4),
])
def test_pool_headroom(views, room):
    assert pool_headroom(views, SaturationLimits(queue_depth=2)) == room


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"queue_depth": 0}, "saturation_queue_depth"),
    ({"kv_usage": 0.0}, "saturation_kv_usage"),
    ({"kv_usage": 1.5}, "saturation_kv_usage"),
])
def test_saturation_limits_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SaturationLimits(**kwargs)


OBJECTIVES = (Objective("premium", 10, ("tiny", "support-lora"), ttft_ms=500),
              Objective("batch", -5, ("bulk-lora",)),
              Objective("interactive", 5, tpot_ms=50))
KEY_A = "key-" + __import__("hashlib").sha256(b"sk-a").hexdigest()[:12]


@pytest.mark.parametrize(("headers", "model", "ticket"), [
    ({}, "other", FlowTicket()),
    ({"x-gateway-inference-fairness-id": "team-a"}, "other", FlowTicket(flow="team-a")),
    # no fairness id: the API key's tenant (a hash, never the key)
    ({"authorization": "Bearer sk-a"}, "other", FlowTicket(flow=KEY_A)),
    ({"authorization": "Bearer sk-a", "x-gateway-inference-fairness-id": "t"}, None,
     FlowTicket(flow="t")),
    # the model or adapter picks the objective ...
    ({}, "support-lora", FlowTicket(priority=10, objective="premium", ttft_slo_s=0.5)),
    ({}, "bulk-lora", FlowTicket(priority=-5, objective="batch")),
    # ... unless a header names one
    ({"x-gateway-inference-objective": "interactive"}, "bulk-lora",
     FlowTicket(priority=5, objective="interactive", tpot_slo_s=0.05)),
    # SLO headers override the objective's
    ({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "20"}, "tiny",
     FlowTicket(priority=10, objective="premium", ttft_slo_s=0.25, tpot_slo_s=0.02)),
    ({"x-slo-ttft-ms": "1500"}, None, FlowTicket(ttft_slo_s=1.5)),
])
def test_classify(headers, model, ticket):
    assert classify(headers, model, OBJECTIVES) == ticket


@pytest.mark.parametrize(("headers", "header"), [
    ({"x-gateway-inference-objective": "gold"}, "x-gateway-inference-objective"),
    ({"x-gateway-inference-fairness-id": "a b"}, "x-gateway-inference-fairness-id"),
    ({"x-gateway-inference-fairness-id": "x" * 129}, "x-gateway-inference-fairness-id"),
    ({"x-slo-ttft-ms": "soon"}, "x-slo-ttft-ms"),
    ({"x-slo-ttft-ms": "-1"}, "x-slo-ttft-ms"),
    ({"x-slo-tpot-ms": "nan"}, "x-slo-tpot-ms"),
])
def test_classify_refuses_naming_the_header(headers, header):
    with pytest.raises(BadFlowHeader, match=header) as caught:
        classify(headers, "tiny", OBJECTIVES)
    assert caught.value.header == header


def test_objectives_round_trip():
    assert parse_objectives(objectives_json(OBJECTIVES)) == OBJECTIVES


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON"),
    ('{"name": "a"}', "JSON list"),
    ("[1]", r"objectives\[0\] is int"),
    ('[{"name": "a", "prio": 1}]', "unknown field"),
    ('[{"name": ""}]', r"objectives\[0\].name"),
    ('[{"name": "a"}, {"name": "a"}]', "given twice"),
    ('[{"name": "a", "priority": 1.5}]', r"objectives\[0\].priority"),
    ('[{"name": "a", "priority": 5000}]', r"objectives\[0\].priority"),
    ('[{"name": "a", "models": "tiny"}]', r"objectives\[0\].models"),
    ('[{"name": "a", "models": ["m"]}, {"name": "b", "models": ["m"]}]', "one objective"),
    ('[{"name": "a", "ttftMs": 0}]', r"objectives\[0\].ttftMs"),
    ('[{"name": "a", "tpotMs": true}]', r"objectives\[0\].tpotMs"),
])
def test_objectives_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_objectives(text)
