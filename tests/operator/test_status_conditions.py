"""Status helpers: conditions from replica counts, transition times, error messages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.diagnose import Diagnosis
from kvpilot.operator.status import (
    PoolCounts,
    describe_error,
    invalid_spec_conditions,
    merge_conditions,
    model_status,
    own_problem,
    pool_status,
    rollout_conditions,
    transition_event,
    workload_ready,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def summary(conditions):
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


@pytest.mark.parametrize(("pools", "expected"), [
    ({"decode": PoolCounts(1, 1)},
     {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
      "Degraded": ("False", "SpecValid")}),
    ({"decode": PoolCounts(2, 1)},
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "RollingOut"),
      "Degraded": ("False", "SpecValid")}),
    ({"prefill": PoolCounts(2, 2), "decode": PoolCounts(1, 0)},
     {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "RollingOut"),
      "Degraded": ("False", "SpecValid")}),
    ({"decode": PoolCounts(0, 0)},
     {"Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
      "Degraded": ("False", "SpecValid")}),
])
def test_rollout_conditions_from_counts(pools, expected):
    assert summary(rollout_conditions(pools, 3, T0)) == expected
    assert {c["observedGeneration"] for c in rollout_conditions(pools, 3, T0)} == {3}


def test_waiting_message_names_each_pool_behind():
    ready = rollout_conditions({"prefill": PoolCounts(2, 1), "decode": PoolCounts(1, 0)}, 1, T0)[0]
    assert ready["message"] == "waiting for decode 0/1 ready, prefill 1/2 ready"


def test_invalid_spec_is_degraded_and_not_progressing():
    conditions = invalid_spec_conditions("InvalidSpec", "topology.tensorParallel=3 ...", 2, T0)
    assert summary(conditions) == {"Ready": ("False", "InvalidSpec"),
                                   "Progressing": ("False", "InvalidSpec"),
                                   "Degraded": ("True", "InvalidSpec")}
    assert conditions[2]["message"] == "topology.tensorParallel=3 ..."


def test_transition_time_moves_only_when_status_flips():
    before = rollout_conditions({"decode": PoolCounts(1, 0)}, 1, T0)
    same = merge_conditions(before, rollout_conditions({"decode": PoolCounts(2, 0)}, 2, T1))
    assert {c["lastTransitionTime"] for c in same} == {T0}
    flipped = merge_conditions(before, rollout_conditions({"decode": PoolCounts(1, 1)}, 2, T1))
    times = {c["type"]: c["lastTransitionTime"] for c in flipped}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0}


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=3))
def test_ready_is_true_exactly_when_every_pool_is_ready(pairs):
    pools = {f"p{i}": PoolCounts(d, min(r, d)) for i, (d, r) in enumerate(pairs)}
    conditions = {c["type"]: c["status"] for c in rollout_conditions(pools, 1, T0)}
    all_ready = all(c.ready >= c.desired for c in pools.values())
    assert conditions["Ready"] == ("True" if all_ready else "False")
    assert conditions["Progressing"] == ("False" if all_ready else "True")
    assert conditions["Degraded"] == "False"


@pytest.mark.parametrize(("workloads", "ready"), [
    ([], 0),
    ([{"kind": "Deployment", "spec": {"replicas": 3}, "status": {"readyReplicas": 2}}], 2),
    ([{"kind": "Deployment", "spec": {"replicas": 3}}], 0),
    # Each StatefulSet is one multi-node replica: it counts once, and only when all ranks are.
    ([{"kind": "StatefulSet", "spec": {"replicas": 2}, "status": {"readyReplicas": 2}},
      {"kind": "StatefulSet", "spec": {"replicas": 2}, "status": {"readyReplicas": 1}}], 1),
    ([{"kind": "LeaderWorkerSet", "spec": {"replicas": 2}, "status": {"readyReplicas": 2}}], 2),
])
def test_workload_ready(workloads, ready):
    assert workload_ready(workloads) == ready


def test_pool_and_model_status_fields():
    pool = pool_status(3, 1, "a=b", 4, None, T0)
    assert (pool["replicas"], pool["readyReplicas"], pool["selector"]) == (3, 1, "a=b")
    model = model_status({"decode": PoolCounts(2, 2)}, "http://x/v1", 4, None, T0)
    assert model["decodeReplicas"] == "2/2" and model["decode"] == {"desired": 2, "ready": 2}
    assert model["prefill"] is None and model["prefillReplicas"] is None
    assert model["endpoint"] == "http://x/v1"


@pytest.mark.parametrize(("spec", "message"), [
    ({"model": {"name": "m", "source": "s3://x"}}, "model.source: String should match pattern"),
    ({"model": {"name": "m", "source": "dummy:tiny-llama"}, "servingMode": "disaggregated"},
     "servingMode disaggregated needs spec.prefill"),
    ({"model": {"name": "m", "source": "dummy:tiny-llama"}, "topology": {"tensorParallel": 0}},
     "topology.tensorParallel: Input should be greater than or equal to 1"),
])
def test_describe_error_names_the_field(spec, message):
    with pytest.raises(ValidationError) as info:
        InferenceModelSpec.model_validate(spec)
    assert message in describe_error(info.value)
    assert "\n" not in describe_error(info.value)


def test_a_degraded_pool_degrades_the_model_until_it_recovers():
    bad = model_status({"decode": PoolCounts(1, 0)}, None, 2, None, T0,
                       {"m-decode": Diagnosis("ApplyRejected", "spec.template: Invalid")})
    assert summary(bad["conditions"])["Degraded"] == ("True", "PoolDegraded")
    assert bad["conditions"][2]["message"] == "m-decode: spec.template: Invalid"
    assert bad["decodeReplicas"] == "0/1"
    good = model_status({"decode": PoolCounts(1, 1)}, None, 2, bad["conditions"], T1, {})
    assert summary(good["conditions"])["Degraded"] == ("False", "SpecValid")


UNSCHEDULABLE = Diagnosis("Unschedulable", "pod p0: 0/4 nodes are available", "p0")


def test_failing_replicas_name_the_reason_on_pool_and_model():
    pool = pool_status(2, 1, "sel", 3, None, T0, UNSCHEDULABLE)
    assert summary(pool["conditions"]) == {"Ready": ("False", "Unschedulable"),
                                           "Progressing": ("False", "Unschedulable"),
                                           "Degraded": ("True", "Unschedulable")}
    assert pool["conditions"][0]["message"] == "pod p0: 0/4 nodes are available"
    degraded = Diagnosis("Unschedulable", pool["conditions"][2]["message"])
    model = model_status({"decode": PoolCounts(2, 1)}, None, 3, None, T0,
                         {"m-decode": degraded})
    assert summary(model["conditions"])["Degraded"] == ("True", "Unschedulable")
    assert model["conditions"][0]["message"] == "m-decode: pod p0: 0/4 nodes are available"
    assert not own_problem(model["conditions"]) and not own_problem(pool["conditions"])


def test_a_failure_is_ignored_once_every_replica_is_ready():
    pool = pool_status(2, 2, "sel", 3, None, T0, UNSCHEDULABLE)
    assert summary(pool["conditions"])["Ready"] == ("True", "AllReplicasReady")


def test_a_weights_failure_degrades_the_model_and_shows_in_status_weights():
    weights = {"phase": "Failed", "message": "gated", "state": "Failed"}
    model = model_status({"decode": PoolCounts(1, 0)}, None, 1, None, T0, {}, weights,
                         Diagnosis("WeightsDownloadFailed", "weights Job j gave up: gated"))
    assert summary(model["conditions"])["Degraded"] == ("True", "WeightsDownloadFailed")
    assert model["weights"] == weights
    assert model_status({"decode": PoolCounts(1, 0)}, None, 1, None, T0)["weights"] is None


def test_own_problem_is_the_spec_not_the_replicas():
    assert own_problem(invalid_spec_conditions("InvalidSpec", "x", 1, T0))
    assert not own_problem(invalid_spec_conditions("PoolDegraded", "x", 1, T0))
    assert not own_problem(rollout_conditions({"d": PoolCounts(1, 0)}, 1, T0))


def conds(ready: tuple[str, str], degraded: tuple[str, str], message: str = "m"):
    return [{"type": "Ready", "status": ready[0], "reason": ready[1], "message": message},
            {"type": "Degraded", "status": degraded[0], "reason": degraded[1],
             "message": message}]


NOT_READY = conds(("False", "ReplicasNotReady"), ("False", "SpecValid"), "waiting")
READY = conds(("True", "AllReplicasReady"), ("False", "SpecValid"), "decode 1/1 ready")
STUCK = conds(("False", "Unschedulable"), ("True", "Unschedulable"), "pod p0: no gpu")
OOM = conds(("False", "OOMKilled"), ("True", "OOMKilled"), "pod p0: oom")


@pytest.mark.parametrize(("old", "new", "event"), [
    (None, NOT_READY, ("NotReady", "waiting", False)),
    (NOT_READY, NOT_READY, None),
    (NOT_READY, conds(("False", "ReplicasNotReady"), ("False", "SpecValid"), "other text"),
     None),  # only a change of status or reason is a transition
    (NOT_READY, STUCK, ("Unschedulable", "pod p0: no gpu", True)),
    (STUCK, OOM, ("OOMKilled", "pod p0: oom", True)),
    (STUCK, NOT_READY, ("Recovered", "no longer Unschedulable: waiting", False)),
    (NOT_READY, READY, ("Ready", "decode 1/1 ready", False)),
    (READY, NOT_READY, ("NotReady", "waiting", False)),
])
def test_transition_events(old, new, event):
    assert transition_event(old, new) == event
