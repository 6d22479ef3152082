"""Printer-column JSONPaths, evaluated on fixture objects, give the documented `kubectl get` columns."""

from __future__ import annotations

import re
from typing import Any

import pytest
from crd_eval import load_crds

from kvpilot.operator.api import InferenceModelStatus, PoolStatus

_STEP = re.compile(r'\.(\w+)|\[\?\(@\.(\w+)=="([^"]*)"\)\]')


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Gives the values of the `.a.b` and `.a[?(@.k=="v")].b` forms kubectl uses in columns."""
    values, pos = [obj], 0
    while pos < len(path):
        step = _STEP.match(path, pos)
        assert step, f"unsupported JSONPath {path!r} at {path[pos:]!r}"
        key, filter_key, filter_value = step.groups()
        if key:
            values = [v[key] for v in values if isinstance(v, dict) and key in v]
        else:
            values = [item for v in values if isinstance(v, list) for item in v
                      if isinstance(item, dict) and item.get(filter_key) == filter_value]
        pos = step.end()
    return values


def columns(obj: dict[str, Any]) -> dict[str, str]:
    """Gives column name -> cell text as kubectl prints it (empty cell when absent)."""
    crd = load_crds()[obj["kind"]]
    out = {}
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column.get("priority", 0):
            continue
        found = jsonpath(obj, column["jsonPath"])
        out[column["name"]] = "" if not found else str(found[0])
    return out


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
