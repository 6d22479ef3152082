"""The InferenceModel side: budget demands from the API's pools, and the KV%/QUEUE rollup."""

from __future__ import annotations

import pytest

from kvpilot.operator.autoscale.budget import PoolDemand
from kvpilot.operator.autoscale.model import PoolReport, budget_demands, model_fields


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
