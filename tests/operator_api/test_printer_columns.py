"""Printer-column JSONPaths, evaluated on fixture objects, give the documented `kubectl get` columns."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.kubectl_view import columns, jsonpath

from kvpilot.operator.api import InferenceModelStatus, PoolStatus

IM_STATUS = InferenceModelStatus.model_validate({
    "conditions": [{"type": "Progressing", "status": "False"},
                   {"type": "Ready", "status": "True", "reason": "AllReplicasReady"}],
    "observedGeneration": 3, "prefillReplicas": "1/2", "decodeReplicas": "2/2",
    "kvCacheUtilization": 0.42, "kvCachePercent": 42, "queueDepth": 7,
    "weights": {"phase": "Cached", "claim": "m-weights-abc", "state": "Cached"},
}).to_json()
IM = {"kind": "InferenceModel", "metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
      "spec": {"servingMode": "disaggregated",
               "topology": {"tensorParallel": 8, "pipelineParallel": 2, "expertParallel": 4}},
      "status": IM_STATUS}
POOL = {"kind": "DecodePool", "metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"replicas": 3, "modelRef": "m"},
        "status": {**PoolStatus(replicas=3, ready_replicas=2, kv_cache_percent=91,
                                queue_depth=0).to_json(),
                   "conditions": [{"type": "Ready", "status": "False", "reason": "Unschedulable",
                                   "message": "pod p-0: 0/4 nodes are available"}]}}


@pytest.mark.parametrize(("obj", "expected"), [
    (IM, {"READY": "True", "REASON": "AllReplicasReady", "MODE": "disaggregated", "TP": "8",
          "PP": "2", "EP": "4", "PREFILL": "1/2", "DECODE": "2/2", "WEIGHTS": "Cached",
          "KV%": "42", "QUEUE": "7", "AGE": "2026-01-01T00:00:00Z"}),
    ({**IM, "status": {}}, {"READY": "", "REASON": "", "MODE": "disaggregated", "TP": "8",
                           "PP": "2", "EP": "4", "PREFILL": "", "DECODE": "", "WEIGHTS": "",
                           "KV%": "", "QUEUE": "", "AGE": "2026-01-01T00:00:00Z"}),
    (POOL, {"REPLICAS": "3", "READY": "2", "REASON": "Unschedulable", "KV%": "91", "QUEUE": "0",
            "AGE": "2026-01-01T00:00:00Z"}),
    ({**POOL, "kind": "PrefillPool", "status": {}},
     {"REPLICAS": "3", "READY": "", "REASON": "", "KV%": "", "QUEUE": "",
      "AGE": "2026-01-01T00:00:00Z"}),
], ids=["im-ready", "im-no-status", "decode-pool", "prefill-pool-no-status"])
def test_columns(obj: dict[str, Any], expected: dict[str, str]):
    assert columns(obj) == expected


@pytest.mark.parametrize(("path", "expected"), [
    (".a.b", [1]),
    (".a.missing", []),
    ('.l[?(@.t=="x")].v', ["first"]),
    ('.l[?(@.t=="none")].v', []),
])
def test_jsonpath_evaluator(path: str, expected: list[Any]):
    obj = {"a": {"b": 1}, "l": [{"t": "x", "v": "first"}, {"t": "y", "v": "second"}]}
    assert jsonpath(obj, path) == expected
