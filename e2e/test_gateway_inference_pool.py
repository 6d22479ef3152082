"""An InferenceModel with spec.inferencePool on a real cluster: the InferencePool is accepted by
the upstream CRD, selects the model's ready engine pods, and goes when the block is removed.

Needs the Gateway API inference extension's CRDs installed (the test skips, saying so, when
the InferencePool CRD is missing); no gateway or endpoint picker is needed to check the pool.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from e2e.kube import REPO, kubectl, wait_for

pytestmark = pytest.mark.cluster
READY_TIMEOUT = float(os.environ.get("E2E_READY_TIMEOUT", "900"))


def test_inference_pool_selects_the_ready_engines(namespace, operator, inference_pool_crd):
    if not inference_pool_crd:
        pytest.skip("needs the InferencePool CRD (inference.networking.k8s.io/v1) installed")
    manifest = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    name = manifest["metadata"]["name"] = "gateway-tiny"
    manifest["metadata"]["namespace"] = namespace
    manifest["spec"]["inferencePool"] = {"endpointPicker": {"name": f"{name}-epp", "port": 9002}}
    kubectl("apply", "-f", "-", input_text=yaml.safe_dump(manifest))

    def pool() -> dict | None:
        out = kubectl("get", f"inferencepools.inference.networking.k8s.io/{name}", "-o", "json",
                      namespace=namespace, check=False)
        return json.loads(out) if out.strip() else None

    found = wait_for(pool, 120, "InferencePool rendered")
    labels = found["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in labels.items())

    def ready_pods() -> list[dict]:
        pods = json.loads(kubectl("get", "pods", "-l", selector, "-o", "json",
                                  namespace=namespace))["items"]
        return [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                       for c in p["status"].get("conditions", []))]

    pods = wait_for(ready_pods, READY_TIMEOUT, "a ready engine pod in the InferencePool")
    port = found["spec"]["targetPorts"][0]["number"]
    assert port in {p["containerPort"] for c in pods[0]["spec"]["containers"]
                    for p in c.get("ports", [])}
    kubectl("patch", f"inferencemodels.kvpilot.dev/{name}", "--type", "merge", "-p",
            '{"spec": {"inferencePool": null}}', namespace=namespace)
    wait_for(lambda: pool() is None, 120, "InferencePool pruned")
    kubectl("delete", f"inferencemodels.kvpilot.dev/{name}", namespace=namespace)
