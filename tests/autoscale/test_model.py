"""The InferenceModel side: budget demands from the API's pools, and the KV%/QUEUE rollup."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscale.budget import PoolDemand
from kvpilot.operator.autoscale.model import (
    PoolReport,
    budget_demands,
    gpu_budget,
    model_fields,
    model_status_patch,
    within_budget,
)


def pool(name: str, model: str | None, replicas: int, autoscaling: dict | None = None,
         tp: int = 1) -> dict:
    spec = {"replicas": replicas, "topology": {"tensorParallel": tp, "pipelineParallel": 1}}
    if model:
        spec["modelRef"] = model
    if autoscaling is not None:
        spec["autoscaling"] = autoscaling
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def test_budget_demands_table() -> None:
    pools = [pool("m-prefill", "m", 2, {"minReplicas": 1}, tp=2),
             pool("m-decode", "m", 3, {"minReplicas": 2}),
             pool("fixed", "m", 4),
             pool("other", "x", 9, {})]
    shared = {("ns", "m-decode"): PoolReport("m", "decode", 4.5)}
    assert budget_demands(pools, "m", "m-prefill", 5, shared) == [
        PoolDemand("m-prefill", current=2, desired=5, min_replicas=1, gpus_per_replica=2,
                   load=2.0),
        PoolDemand("m-decode", current=3, desired=3, min_replicas=2, gpus_per_replica=1,
                   load=4.5),
        PoolDemand("fixed", current=4, desired=4, min_replicas=4, gpus_per_replica=1,
                   load=4.0),
    ]


@pytest.mark.parametrize(("reports", "expected"), [
    ({}, {}),
    ({("ns", "a-decode"): PoolReport("a", "decode", 1, kv=0.5, queue=3),
      ("ns", "a-prefill"): PoolReport("a", "prefill", 1, kv=0.01, queue=7),
      ("ns", "b-decode"): PoolReport("b", "decode", 1, kv=0.9, queue=50),
      ("other", "a-decode"): PoolReport("a", "decode", 1, kv=0.9, queue=50)},
     {"kvCacheUtilization": 0.5, "kvCachePercent": 50, "queueDepth": 10}),
    ({("ns", "a-decode"): PoolReport("a", "both", 1, kv=None, queue=None)}, {}),
])
def test_model_fields(reports, expected) -> None:
    assert model_fields("a", "ns", reports) == expected


@pytest.mark.parametrize(("im", "budget"), [
    (None, None),
    ({"spec": {}}, None),
    ({"spec": {"gpuBudget": 6}}, 6),
])
def test_gpu_budget(im, budget) -> None:
    assert gpu_budget(im) == budget


# m-prefill (2 GPUs a replica) asks for `desired`; m-decode and fixed hold 3 + 4 GPUs.
@pytest.mark.parametrize(("budget", "desired", "granted", "binds"), [
    (20, 5, 5, False),  # 10 + 7 GPUs fit
    (16, 5, 4, True),   # 9 GPUs left: 4 replicas of 2
    (12, 5, 2, True),   # 5 GPUs left: it keeps its 2, a third does not fit
    (12, 1, 1, False),  # shrinking fits
], ids=["fits", "partly", "holds", "shrinks"])
def test_within_budget(budget, desired, granted, binds) -> None:
    pools = [pool("m-prefill", "m", 2, {"minReplicas": 1}, tp=2),
             pool("m-decode", "m", 3, {"minReplicas": 2}),
             pool("fixed", "m", 4),
             pool("other", "x", 9, {})]
    got, message = within_budget(budget, pools, "m", "m-prefill", desired, {})
    assert got == granted
    assert (message is not None) == binds


IM = {"metadata": {"name": "a"}, "status": {"kvCacheUtilization": 0.5, "kvCachePercent": 50}}
DECISION = {"time": "t", "pool": "a-decode", "fromReplicas": 1, "toReplicas": 2, "reason": "r"}


@pytest.mark.parametrize(("im", "reports", "decision", "expected"), [
    (None, {("ns", "a-decode"): PoolReport("a", "decode", 1, kv=0.9)}, None, None),
    (IM, {}, None, None),
    (IM, {("ns", "a-decode"): PoolReport("a", "decode", 1, kv=0.5)}, None, None),
    (IM, {("ns", "a-decode"): PoolReport("a", "decode", 1, kv=0.9, queue=2)}, None,
     {"kvCacheUtilization": 0.9, "kvCachePercent": 90, "queueDepth": 2}),
    (IM, {("ns", "a-decode"): PoolReport("a", "decode", 1, kv=0.5)}, DECISION,
     {"kvCacheUtilization": 0.5, "kvCachePercent": 50, "lastScaleDecision": DECISION}),
], ids=["no-model", "nothing-seen", "unchanged", "changed", "decision"])
def test_model_status_patch(im, reports, decision, expected) -> None:
    assert model_status_patch(im, "ns", reports, decision) == expected
