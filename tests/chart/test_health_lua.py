"""Argo CD health scripts, run in a real Lua runtime (lupa) over status fixtures."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.kubectl_view import LUA_SCRIPTS, argocd_health, lua_script

from kvpilot.operator.diagnose import REASONS, Diagnosis
from kvpilot.operator.status import failing_conditions


def health(kind: str, obj: dict[str, Any]) -> tuple[str, str]:
    return argocd_health({**obj, "kind": kind})


def cond(kind: str, status: str, reason: str = "", message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def im(status: dict[str, Any] | None, generation: int = 2) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": "m", "generation": generation}, "spec": {}}
    if status is not None:
        obj["status"] = status
    return obj


def pool(status: dict[str, Any] | None, replicas: int = 2) -> dict[str, Any]:
    obj = im(status)
    obj["spec"] = {"replicas": replicas}
    return obj


REPLICAS = {"prefillReplicas": "1/1", "decodeReplicas": "2/2"}
CASES = [
    ("InferenceModel", im(None), "Progressing", "Waiting for the operator to write status"),
    ("InferenceModel", im({"observedGeneration": 1, "conditions": [cond("Ready", "True")]}),
     "Progressing", "Waiting for the operator to observe generation 2"),
    ("InferenceModel", im({"conditions": [cond("Ready", "True")]}), "Progressing",
     "Waiting for the operator to observe generation 2"),
    ("InferenceModel", im({"observedGeneration": 2, **REPLICAS,
                           "conditions": [cond("Ready", "True"), cond("Degraded", "False")]}),
     "Healthy", "Ready (prefill 1/1, decode 2/2)"),
    ("InferenceModel", im({"observedGeneration": 2, "conditions": [
        cond("Ready", "False"), cond("Degraded", "True", "TopologyInvalid",
                                     "topology.tensorParallel=3 does not divide 32")]}),
     "Degraded", "topology.tensorParallel=3 does not divide 32"),
    ("InferenceModel", im({"observedGeneration": 2, "decodeReplicas": "0/2", "conditions": [
        cond("Ready", "False", "ReplicasNotReady"), cond("Progressing", "True", "Rollout",
                                                          "waiting for 2 decode replicas")]}),
     "Progressing", "waiting for 2 decode replicas (decode 0/2)"),
    ("InferenceModel", im({"observedGeneration": 2, "conditions": [
        cond("Ready", "False", "PodsCrashing"), cond("Progressing", "False")]}),
     "Degraded", "PodsCrashing"),
    ("InferenceModel", im({"observedGeneration": 2, "conditions": []}), "Progressing",
     "Waiting for replicas to become ready"),
    ("DecodePool", pool(None), "Progressing", "Waiting for the operator to write status"),
    ("DecodePool", pool({"observedGeneration": 2, "readyReplicas": 2,
                         "conditions": [cond("Ready", "True")]}),
     "Healthy", "Ready (2/2 replicas ready)"),
    ("PrefillPool", pool({"observedGeneration": 2, "readyReplicas": 1,
                          "conditions": [cond("Ready", "False"),
                                         cond("Progressing", "True", "ScalingUp")]}),
     "Progressing", "ScalingUp (1/2 replicas ready)"),
    ("PrefillPool", pool({"observedGeneration": 2, "conditions": [
        cond("Degraded", "True", "Unschedulable", "no node offers amd.com/cpx_nps4")]}),
     "Degraded", "no node offers amd.com/cpx_nps4"),
    ("DecodePool", pool({"observedGeneration": 1}), "Progressing",
     "Waiting for the operator to observe generation 2"),
]


@pytest.mark.parametrize(("kind", "obj", "status", "message"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_health(kind: str, obj: dict[str, Any], status: str, message: str):
    assert health(kind, obj) == (status, message)


def test_snippet_maps_each_kind_to_its_script(render):
    snippet = next(o for o in render(sets=("argocd.healthChecks=true",))
                   if o["metadata"]["name"].endswith("-argocd-health"))
    for kind in LUA_SCRIPTS:
        key = f"resource.customizations.health.kvpilot.dev_{kind}"
        assert snippet["data"][key].strip() == lua_script(kind).strip()


@pytest.mark.parametrize("reason", REASONS)
def test_each_failure_the_operator_writes_is_degraded(reason: str):
    """The conditions the operator writes for failing replicas read Degraded, not Progressing."""
    failing = failing_conditions(Diagnosis(reason, f"m-decode: pod m-decode-0: {reason}"), 2,
                                 "2026-01-01T00:00:00Z")
    status = {"observedGeneration": 2, "decodeReplicas": "0/1", "conditions": failing,
              "weights": {"phase": "Downloading", "state": "Downloading 42%"}}
    assert health("InferenceModel", im(status)) == (
        "Degraded", f"m-decode: pod m-decode-0: {reason}")
    assert health("DecodePool", pool({**status, "readyReplicas": 0}))[0] == "Degraded"


def test_a_download_shows_in_the_progress_message():
    status = {"observedGeneration": 2, "decodeReplicas": "0/1",
              "weights": {"phase": "Downloading", "state": "Downloading 42%"},
              "conditions": [cond("Ready", "False", "ReplicasNotReady"),
                             cond("Progressing", "True", "RollingOut", "waiting for decode")]}
    assert health("InferenceModel", im(status)) == (
        "Progressing", "waiting for decode (decode 0/1, weights Downloading 42%)")
