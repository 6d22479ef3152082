"""The InferencePool (Gateway API inference extension) kvpilot renders: valid for the upstream
API, selecting the serving engines, and owned, applied and pruned like every other child."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import IMS, NAMESPACE, REPO, eventually, running_operator
from test_reconcile_kmock import IM_PATH, MERGE, tiny

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig

HERE = Path(__file__).parent
POOLS = "inference.networking.k8s.io/v1/inferencepools"
PICKER = {"endpointPicker": {"name": "chat-epp", "port": 9002}}


def _crd_eval() -> Any:
    """Gives tests/operator_api/crd_eval.py (shared helper, loaded by path)."""
    spec = importlib.util.spec_from_file_location(
        "crd_eval_for_gateway", REPO / "tests" / "operator_api" / "crd_eval.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CRD_EVAL = _crd_eval()


def schemas() -> list[dict[str, Any]]:
    """Gives the InferencePool CRD of the tests, and the upstream file when INFERENCEPOOL_CRD
    names a copy (kubernetes-sigs/gateway-api-inference-extension, config/crd/bases/)."""
    paths = [HERE / "inferencepool_crd.yaml"]
    if os.environ.get("INFERENCEPOOL_CRD"):
        paths.append(Path(os.environ["INFERENCEPOOL_CRD"]))
    return [yaml.safe_load(p.read_text()) for p in paths]


def rendered(spec: dict[str, Any], config: RenderConfig | None = None) -> dict[str, Any]:
    """Gives the InferencePool rendered for a tiny model with `spec` added."""
    parsed = InferenceModelSpec.model_validate(tiny("chat", **spec)["spec"])
    im = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
          "metadata": {"name": "chat", "namespace": NAMESPACE, "uid": "u", "generation": 1}}
    objects = render_children(im, parsed, owned_pools(parsed, "chat"),
                              config or RenderConfig(inference_pool=True))
    return next(o for o in objects if o["kind"] == "InferencePool")


def errors(obj: dict[str, Any]) -> list[str]:
    """Gives what the API server would answer, under every InferencePool schema at hand."""
    return [e for crd in schemas() for e in CRD_EVAL.api_server_errors(crd, obj)]


def test_the_rendered_pool_selects_the_engines_and_names_the_picker():
    pool = rendered({"inferencePool": PICKER})
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "chat"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "InferenceModel"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"kvpilot.dev/model": "chat",
                                     "kvpilot.dev/pool": "chat-decode"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002},
                              "failureMode": "FailClose"}}
    assert errors(pool) == []


def test_multi_node_replicas_put_only_their_leaders_in_the_pool():
    pool = rendered({"inferencePool": PICKER, "accelerator": {"vendor": "nvidia"},
                     "topology": {"tensorParallel": 8, "pipelineParallel": 2}})
    assert pool["spec"]["selector"]["matchLabels"]["apps.kubernetes.io/pod-index"] == "0"
    assert errors(pool) == []


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["targetPorts"].append({"number": 8000}), "port number must be unique"),
    (lambda s: s["endpointPickerRef"].pop("port"), "port is required"),
    (lambda s: s["selector"].update(matchLabels={}), "matchLabels"),
    (lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"), "Sometimes"),
])
def test_the_schema_check_catches_what_the_api_server_would_refuse(change, message):
    pool = rendered({"inferencePool": PICKER})
    change(pool["spec"])
    assert any(message in e for e in errors(pool)), errors(pool)


def test_disaggregated_models_and_an_operator_without_the_flag_refuse_it():
    disaggregated = tiny("chat", inferencePool=PICKER, servingMode="disaggregated",
                         prefill={})["spec"]
    with pytest.raises(ValueError, match="inferencePool with servingMode=disaggregated"):
        InferenceModelSpec.model_validate(disaggregated)
    crd = CRD_EVAL.load_crds()["InferenceModel"]
    manifest = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
                "metadata": {"name": "chat"}, "spec": disaggregated}
    assert any("endpoint picker" in e for e in CRD_EVAL.api_server_errors(crd, manifest))
    with pytest.raises(ValueError, match="--inference-pool"):
        rendered({"inferencePool": PICKER}, RenderConfig())


async def test_the_operator_applies_and_prunes_the_pool(api, client):
    api.add_crd(yaml.safe_load((HERE / "inferencepool_crd.yaml").read_text()))
    await client.post(IM_PATH, json=tiny("gw", inferencePool=PICKER))
    async with running_operator(inference_pool=True):
        pool = await eventually(lambda: api.get(POOLS, NAMESPACE, "gw"), what="InferencePool")
        im = api.get(IMS, NAMESPACE, "gw")
        assert pool["metadata"]["ownerReferences"][0]["uid"] == im["metadata"]["uid"]
        assert owners_of(pool) == {"kvpilot"}
        r = await client.patch(f"{IM_PATH}/gw", headers=MERGE,
                               json={"spec": {"inferencePool": None}})
        assert r.status_code == 200, r.text
        await eventually(lambda: api.get(POOLS, NAMESPACE, "gw") is None, what="pruned")


def owners_of(obj: dict[str, Any]) -> set[str]:
    return {e["manager"] for e in obj["metadata"].get("managedFields", [])}
