"""Argo CD health scripts, run in a real Lua runtime (lupa) over status fixtures."""

from __future__ import annotations

from typing import Any

import pytest
from chart_helpers import CHART

SCRIPTS = {"InferenceModel": "inferencemodel.lua", "PrefillPool": "pool.lua",
           "DecodePool": "pool.lua"}


def script(kind: str) -> str:
    """Gives the standalone script the chart renders for `kind`: its replicas() + health.lua."""
    files = CHART / "files" / "argocd"
    return (files / SCRIPTS[kind]).read_text() + "\n" + (files / "health.lua").read_text()


def health(kind: str, obj: dict[str, Any]) -> tuple[str, str]:
    """Gives (status, message) of Argo CD's health script for `obj`.

    Lua 5.1, the language of gopher-lua, which Argo CD embeds.
    """
    from lupa.lua51 import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    assert lua.lua_version == (5, 1)

    def to_lua(value: Any) -> Any:
        if isinstance(value, dict):
            return lua.table_from({k: to_lua(v) for k, v in value.items()})
        if isinstance(value, list):
            return lua.table_from([to_lua(v) for v in value])
        return value

    lua.globals().obj = to_lua(obj)
    result = lua.execute(script(kind))
    return result["status"], result["message"]


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
    for kind in SCRIPTS:
        key = f"resource.customizations.health.kvpilot.dev_{kind}"
        assert snippet["data"][key].strip() == script(kind).strip()
