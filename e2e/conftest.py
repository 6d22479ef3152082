"""Real-cluster fixtures: run only when KUBECONFIG points at a cluster; skip with that reason otherwise.

The suite installs the CRDs, runs `kvpilot operator` on this machine against
the cluster (so no operator image is needed), and uses a fresh namespace per
run. Set KVPILOT_ENGINE_IMAGE / KVPILOT_ROUTER_IMAGE to images the cluster can
pull; E2E_READY_TIMEOUT (seconds, default 900) bounds the wait for Ready.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.kube import REPO, kubectl, kubectl_path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skips every e2e test, naming the reason, when there is no cluster or no kubectl."""
    reason = None
    if not os.environ.get("KUBECONFIG"):
        reason = "needs a real cluster: set KUBECONFIG to run the e2e suite"
    elif kubectl_path() is None:
        reason = "needs kubectl on PATH or in .tools/bin (scripts/extract_k8s_tools.py)"
    if reason:
        # The hook sees the whole session's items, not only this folder's.
        here = Path(__file__).parent
        for item in items:
            if here in item.path.parents:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def namespace() -> Iterator[str]:
    """Gives a fresh namespace with kvpilot's CRDs installed; deletes it afterwards."""
    name = f"kvpilot-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("apply", "-f", str(REPO / "crds"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s",
            "crd/inferencemodels.kvpilot.dev", "crd/decodepools.kvpilot.dev",
            "crd/prefillpools.kvpilot.dev")
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)


INFERENCE_POOL_CRD = "crd/inferencepools.inference.networking.k8s.io"


@pytest.fixture(scope="session")
def inference_pool_crd() -> bool:
    """Gives whether the cluster has the Gateway API inference extension's InferencePool CRD."""
    return bool(kubectl("get", INFERENCE_POOL_CRD, "-o", "name", check=False).strip())


@pytest.fixture(scope="session")
def operator(namespace: str, inference_pool_crd: bool) -> Iterator[subprocess.Popen[bytes]]:
    """Runs `kvpilot operator` for the test namespace on this machine (rendering InferencePools
    when the cluster has their CRD)."""
    command = [sys.executable, "-m", "kvpilot.cli.main", "operator", "-n", namespace,
               "--standalone", *(["--inference-pool"] if inference_pool_crd else [])]
    for flag, variable in (("--engine-image", "KVPILOT_ENGINE_IMAGE"),
                           ("--router-image", "KVPILOT_ROUTER_IMAGE")):
        if os.environ.get(variable):
            command += [flag, os.environ[variable]]
    proc = subprocess.Popen(command)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
