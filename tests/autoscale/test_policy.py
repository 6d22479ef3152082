"""Table tests of the pure autoscaling policy: each signal, tolerance, windows, rates, bounds, gaps."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.operator.autoscale.policy import PolicyState, decide
from kvpilot.operator.autoscale.signals import PoolMetrics
from kvpilot.operator.autoscale.spec import PolicySpec, ScalingRules, from_api, role_targets

NOW = 10_000.0
SETTLED = PolicyState(since=0.0)  # history older than every window: nothing holds a change


UP_RULES = ScalingRules(0, 4, 60)
DOWN_RULES = ScalingRules(300, 1, 60)
WIDE = ScalingRules(0, 100, 60)


def spec(role: str = "decode", lo: int = 1, hi: int = 20, up: ScalingRules = UP_RULES,
         down: ScalingRules = DOWN_RULES, **targets: float) -> PolicySpec:
    return PolicySpec(role=role, min_replicas=lo, max_replicas=hi,
                      targets=role_targets(role, targets), scale_up=up, scale_down=down)


def m(n: int, kv: float | None = 0.5, waiting: float | None = 0.0,
      running: float | None = None, tokens: float | None = 0.0, ttft=None, itl=None,
      age: float = 0.0, demand: int = 0, startup: float | None = None) -> PoolMetrics:
    """Metrics of n reporting replicas; `running` defaults to a level inside every band."""
    return PoolMetrics(time=NOW - age, replicas_reporting=n, kv_cache_utilization=kv,
                       requests_waiting=waiting,
                       requests_running=96.0 * n if running is None else running,
                       waiting_prompt_tokens=tokens, ttft_p90_seconds=ttft,
                       itl_p90_seconds=itl, demand=demand, startup_seconds=startup)


CASES = [
    # id, spec, state, metrics, current, desired, winning signal, held-by text
    ("kv above target", spec(), SETTLED, m(4, kv=0.95), 4, 5, "kvCacheUtilization", None),
    ("kv inside tolerance", spec(), SETTLED, m(4, kv=0.85), 4, 4, "kvCacheUtilization", None),
    ("kv below band scales down one", spec(), SETTLED, m(4, kv=0.3, running=0), 4, 3,
     "kvCacheUtilization", None),
    ("running requests", spec(up=WIDE), SETTLED, m(4, kv=0.5, running=1200), 4, 13,
     "runningRequestsPerReplica", None),
    ("running requests, rate limited", spec(), SETTLED, m(4, kv=0.5, running=1200), 4, 8,
     "runningRequestsPerReplica", "rate limit 4 per 60s"),
    ("largest signal wins", spec(), SETTLED, m(4, kv=0.95, running=520), 4, 6,
     "runningRequestsPerReplica", None),
    ("running below target votes by batch utilisation", spec(), SETTLED,
     m(4, kv=0.1, running=100), 4, 3, "runningRequestsPerReplica", None),
    ("prefill queue depth, rate limited", spec("prefill"), SETTLED, m(2, waiting=80), 2, 6,
     "queueDepthPerReplica", "rate limit 4 per 60s"),
    ("prefill queue depth, wide rate", spec("prefill", up=WIDE), SETTLED,
     m(2, waiting=80), 2, 11, "queueDepthPerReplica", None),
    ("queue 1.5x its target is 5% more load: hold", spec("prefill"), SETTLED,
     m(4, waiting=4 * 6.0), 4, 4, "queueDepthPerReplica", None),
    ("prefill waiting prompt tokens", spec("prefill", waitingPromptTokensPerReplica=1000),
     SETTLED, m(3, waiting=6, tokens=4500), 3, 5, "waitingPromptTokensPerReplica", None),
    ("short queue votes by implied utilisation", spec("prefill"), SETTLED, m(4, waiting=2.0),
     4, 3, "queueDepthPerReplica", None),
    ("token backlog below target has no vote", spec("prefill"), SETTLED,
     m(4, waiting=16, tokens=100), 4, 4, "queueDepthPerReplica", None),
    ("decode queue when slots run out", spec(), SETTLED, m(4, kv=0.8, waiting=40), 4, 6,
     "queueDepthPerReplica", None),
    ("ttft slo breached", spec("both", ttftSeconds=2.0), SETTLED, m(4, ttft=3.0), 4, 6,
     "ttftSeconds", None),
    ("itl slo breached", spec(itlSeconds=0.05), SETTLED, m(2, itl=0.08), 2, 4,
     "itlSeconds", None),
    ("fast ttft does not vote down", spec("prefill", ttftSeconds=2.0), SETTLED,
     m(4, waiting=16, ttft=0.1), 4, 4, "queueDepthPerReplica", None),
    ("maxReplicas bounds up", spec(hi=5), SETTLED, m(4, kv=1.0, running=2000), 4, 5,
     "runningRequestsPerReplica", "maxReplicas"),
    ("minReplicas bounds down", spec(lo=3), SETTLED, m(3, kv=0.1, running=0), 3, 3,
     "kvCacheUtilization", "minReplicas"),
    ("above maxReplicas comes down even without data", spec(hi=3), SETTLED, None, 5, 3,
     None, "maxReplicas"),
    ("below minReplicas goes up", spec(lo=2), SETTLED, m(1, kv=0.5, running=96), 1, 2,
     "runningRequestsPerReplica", "minReplicas"),
    ("scale-down window holds", spec(), PolicyState(since=0.0, recommendations=((NOW - 100, 4),)),
     m(4, kv=0.2, running=100), 4, 4, "runningRequestsPerReplica", "scale-down window 300s"),
    ("scale-down after the window", spec(),
     PolicyState(since=0.0, recommendations=((NOW - 301, 4),)),
     m(4, kv=0.1, running=20), 4, 3, "kvCacheUtilization", "rate limit 1 per 60s"),
    ("scale-down window takes the window's highest", spec(down=ScalingRules(300, 10, 60)),
     PolicyState(since=0.0, recommendations=((NOW - 200, 3), (NOW - 100, 2))),
     m(4, kv=0.1, running=20), 4, 3, "kvCacheUtilization", "scale-down window"),
    ("scale-up window holds", spec(up=ScalingRules(30, 4, 60)),
     PolicyState(since=0.0, recommendations=((NOW - 15, 4),)), m(4, kv=0.95), 4, 4,
     "kvCacheUtilization", "scale-up window 30s"),
    ("scale-up window passed", spec(up=ScalingRules(30, 4, 60)),
     PolicyState(since=0.0, recommendations=((NOW - 31, 4), (NOW - 15, 6))), m(4, kv=0.95),
     4, 5, "kvCacheUtilization", None),
    ("rate limit counts earlier changes", spec(), PolicyState(since=0.0, changes=((NOW - 30, 3),)),
     m(7, kv=1.0, running=3000), 7, 8, "runningRequestsPerReplica", "rate limit"),
    ("down rate limit spent", spec(), PolicyState(since=0.0, changes=((NOW - 20, -1),)),
     m(4, kv=0.1, running=0), 4, 4, "kvCacheUtilization", "rate limit"),
    ("fresh start never scales down", spec(), PolicyState(), m(4, kv=0.1, running=0), 4, 4,
     "kvCacheUtilization", "scale-down window"),
    ("fresh start scales up", spec(), PolicyState(), m(4, kv=0.95), 4, 5,
     "kvCacheUtilization", None),
    ("no metrics holds", spec(), SETTLED, None, 4, 4, None, "missing data (no metrics)"),
    ("stale metrics hold", spec(), SETTLED, m(4, kv=0.1, running=0, age=120), 4, 4, None,
     "missing data (metrics 120s old"),
    ("stale metrics do not scale up", spec(), SETTLED, m(4, kv=0.99, age=120), 4, 4, None,
     "missing data (metrics 120s old"),
    ("partial scrape holds low load", spec(), SETTLED, m(2, kv=0.1, running=0), 4, 4,
     "kvCacheUtilization", "missing data (2/4 replicas"),
    ("partial scrape still scales up", spec(), SETTLED, m(3, kv=1.0, running=450), 4, 5,
     "runningRequestsPerReplica", None),
    ("scale-up waits for the pods it started", spec(),
     PolicyState(since=0.0, changes=((NOW - 30, 2),)), m(3, kv=1.0, running=900), 6, 6,
     "runningRequestsPerReplica", "waiting for started pods (3/6 report"),
    ("pods that never report stop blocking", spec(),
     PolicyState(since=0.0, changes=((NOW - 130, 2),)), m(3, kv=1.0, running=900), 6, 10,
     "runningRequestsPerReplica", None),
    ("engines that start slowly (warm-up included) hold longer", spec(),
     PolicyState(since=0.0, changes=((NOW - 130, 2),)), m(3, kv=1.0, running=900, startup=200),
     6, 6, "runningRequestsPerReplica", "waiting for started pods (3/6 report, up to 200s)"),
    ("a reported start-up shorter than the spec's changes nothing", spec(),
     PolicyState(since=0.0, changes=((NOW - 130, 2),)), m(3, kv=1.0, running=900, startup=40),
     6, 10, "runningRequestsPerReplica", None),
    ("absent signal holds", spec(), SETTLED, m(4, kv=None, running=0), 4, 4,
     "runningRequestsPerReplica", "no value for kvCacheUtilization"),
    ("scale from zero on router demand", spec(lo=0), SETTLED, m(0, demand=3), 0, 1, None, None),
    ("zero stays zero without demand", spec(lo=0), SETTLED, m(0), 0, 0, None, None),
    ("idle pool scales to zero", spec(lo=0), SETTLED, m(1, kv=0.0, running=0), 1, 0,
     "kvCacheUtilization", None),
    ("idle pool keeps minReplicas 1", spec(lo=1), SETTLED, m(1, kv=0.0, running=0), 1, 1,
     "kvCacheUtilization", "minReplicas"),
]


@pytest.mark.parametrize(("case", "pspec", "state", "metrics", "current", "desired", "signal",
                          "held"), CASES, ids=[c[0] for c in CASES])
def test_decide_table(case, pspec, state, metrics, current, desired, signal, held) -> None:
    d = decide(pspec, state, [] if metrics is None else [metrics], current, NOW)
    assert d.desired == desired, (case, d)
    assert (d.vote.signal if d.vote else None) == signal, (case, d)
    if held is None:
        assert not any("window" in h or "missing" in h for h in d.held_by), d.held_by
    else:
        assert any(held in h for h in d.held_by), (case, d.held_by)


@pytest.mark.parametrize(("before", "expected"), [(120.0, 2), (60.0, 6), (None, 6)])
def test_a_draining_backlog_adds_no_replicas(before, expected) -> None:
    """80 waiting on 2 replicas asks for more, unless the backlog shrank since the last scrape."""
    history = [m(2, waiting=80)]
    if before is not None:
        history.insert(0, replace(m(2, waiting=before), time=NOW - 15))
    d = decide(spec("prefill"), SETTLED, history, 2, NOW)
    assert d.desired == expected
    assert d.vote is not None and d.vote.signal == "queueDepthPerReplica"


def test_scale_from_zero_reason_names_demand() -> None:
    d = decide(spec(lo=0), SETTLED, [m(0, demand=3)], 0, NOW)
    assert d.reason == "router holds 3 requests for a pool with no ready replica"


def test_state_keeps_only_the_windows() -> None:
    state = PolicyState(since=0.0, recommendations=tuple((NOW - s, 4) for s in (900, 299, 10)),
                        changes=((NOW - 500, 1), (NOW - 10, 1)))
    d = decide(spec(), state, [m(4, kv=0.8)], 4, NOW)
    assert d.state.recommendations == ((NOW - 299, 4), (NOW - 10, 4), (NOW, 4))
    assert d.state.changes == ((NOW - 10, 1),)


def test_from_api_dict_uses_crd_names_and_role_defaults() -> None:
    raw = {"minReplicas": 0, "maxReplicas": 9, "intervalSeconds": 10,
           "targets": {"kvCacheUtilization": 0.7, "queueDepthPerReplica": 2.0,
                       "ttftSeconds": 1.5},
           "scaleUp": {"stabilizationWindowSeconds": 0, "maxReplicasPerPeriod": 8},
           "scaleDown": {"stabilizationWindowSeconds": 600, "maxReplicasPerPeriod": 2,
                         "periodSeconds": 30}}
    pre = from_api(raw, "prefill")
    dec = from_api(raw, "decode", gpus_per_replica=8)
    assert dict(pre.targets) == {"queueDepthPerReplica": 2.0,
                                 "waitingPromptTokensPerReplica": 16384.0, "ttftSeconds": 1.5}
    assert dict(dec.targets) == {"kvCacheUtilization": 0.7, "runningRequestsPerReplica": 96.0,
                                 "queueDepthPerReplica": 2.0}
    assert (dec.min_replicas, dec.max_replicas, dec.gpus_per_replica) == (0, 9, 8)
    assert dec.scale_down == ScalingRules(600, 2, 30)
    assert dec.scale_up == ScalingRules(0, 8, 60)
    assert dec.max_metrics_age_seconds == 40


def test_from_api_reads_the_crd_model() -> None:
    """The operator API's pydantic model (defaults filled) maps field by field."""
    from kvpilot.operator.api.autoscaling import AutoscalingSpec

    model = AutoscalingSpec.model_validate({
        "minReplicas": 2, "maxReplicas": 6, "tolerance": 0.2,
        "targets": {"queueDepthPerReplica": 3, "runningRequestsPerReplica": 64,
                    "itlSeconds": 0.04}})
    got = from_api(model, "decode")
    assert dict(got.targets) == {"kvCacheUtilization": 0.8, "runningRequestsPerReplica": 64.0,
                                 "queueDepthPerReplica": 3.0, "itlSeconds": 0.04}
    assert (got.min_replicas, got.max_replicas, got.tolerance) == (2, 6, 0.2)
    assert (got.interval_seconds, got.max_metrics_age_seconds) == (15, 60)
    assert got.scale_up == ScalingRules(0, 4, 60) and got.scale_down == ScalingRules(300, 1, 60)
    nulls = from_api({"maxMetricsAgeSeconds": None, "scaleUp": {"periodSeconds": None}}, "both")
    assert nulls.max_metrics_age_seconds == 60 and nulls.scale_up.period_seconds == 60


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_replicas": 3, "max_replicas": 2}, "autoscaling.minReplicas=3 and maxReplicas=2"),
    ({"targets": {"kvCacheUtilization": 0}}, "autoscaling.targets.kvCacheUtilization=0"),
    ({"targets": {"gpuDuty": 0.5}}, "autoscaling.targets.gpuDuty=0.5"),
    ({"role": "router"}, "role='router' is invalid"),
])
def test_invalid_spec_names_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PolicySpec(**kwargs)


metrics_st = st.builds(
    PoolMetrics, time=st.floats(NOW - 200, NOW), replicas_reporting=st.integers(0, 30),
    kv_cache_utilization=st.none() | st.floats(0, 1),
    requests_waiting=st.none() | st.floats(0, 1000),
    requests_running=st.none() | st.floats(0, 10_000),
    waiting_prompt_tokens=st.none() | st.floats(0, 1e6),
    ttft_p90_seconds=st.none() | st.floats(0, 30), itl_p90_seconds=st.none() | st.floats(0, 1),
    demand=st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(metrics=metrics_st, current=st.integers(0, 30), lo=st.integers(0, 5),
       span=st.integers(0, 20), role=st.sampled_from(["prefill", "decode", "both"]),
       history=st.lists(st.tuples(st.floats(NOW - 400, NOW - 1), st.integers(0, 30)),
                        max_size=5))
def test_invariants(metrics, current, lo, span, role, history) -> None:
    """Bounds hold, one step never exceeds the rate limit, and gaps never shrink a pool."""
    pspec = spec(role, lo=lo, hi=lo + max(span, 1), ttftSeconds=2.0)
    state = PolicyState(since=0.0, recommendations=tuple(sorted(history)))
    d = decide(pspec, state, [] if metrics is None else [metrics], current, NOW)
    in_bounds = lo <= current <= pspec.max_replicas
    if in_bounds:
        assert lo <= d.desired <= pspec.max_replicas
        assert -1 <= d.desired - current <= 4
    gap = decide(pspec, state, [], current, NOW)
    partial = decide(pspec, state, [replace(metrics, replicas_reporting=max(current - 1, 0))],
                     current, NOW)
    if in_bounds:
        assert gap.desired == current
        assert partial.desired >= current
