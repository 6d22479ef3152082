"""Apply an InferenceModel to a real cluster, wait for Ready, read it with kubectl, delete it."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from e2e.kube import REPO, kubectl, wait_for

pytestmark = pytest.mark.cluster
READY_TIMEOUT = float(os.environ.get("E2E_READY_TIMEOUT", "900"))


def condition(obj: dict, kind: str) -> str | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond["type"] == kind:
            return cond["status"]
    return None


def test_tiny_model_becomes_ready_and_is_cleaned_up(namespace, operator):
    manifest = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    manifest["metadata"]["namespace"] = namespace
    name = manifest["metadata"]["name"]
    kubectl("apply", "-f", "-", input_text=yaml.safe_dump(manifest))

    def fetch() -> dict:
        return json.loads(kubectl("get", f"inferencemodels.kvpilot.dev/{name}", "-o", "json",
                                  namespace=namespace))

    im = wait_for(lambda: (o := fetch()) and condition(o, "Ready") == "True" and o,
                  READY_TIMEOUT, f"InferenceModel {name} Ready")
    assert im["status"]["observedGeneration"] == im["metadata"]["generation"]
    assert im["status"]["decodeReplicas"] == "1/1"
    assert im["status"]["endpoint"].startswith(f"http://{name}-router.{namespace}.svc")

    table = kubectl("get", "inferencemodels.kvpilot.dev", namespace=namespace)
    header, row = table.splitlines()[:2]
    assert header.split()[:2] == ["NAME", "READY"]
    assert row.split()[:2] == [name, "True"]
    pods = kubectl("get", "pods", "-l", f"kvpilot.dev/model={name}", "-o", "name",
                   namespace=namespace)
    assert pods.strip(), "no engine or router pods"

    kubectl("delete", f"inferencemodels.kvpilot.dev/{name}", "--wait=true",
            namespace=namespace, timeout=300)
    wait_for(lambda: not kubectl("get", "deployments,decodepools.kvpilot.dev", "-l",
                                 f"kvpilot.dev/model={name}", "-o", "name",
                                 namespace=namespace).strip(),
             300, "garbage collection of the model's children")
