"""Why a pool is not ready, from its pods and workloads: each failure gives its reason."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.pod_states import (
    CRASH,
    FETCH_FAILED,
    NOW,
    OOM,
    PULL,
    UNSCHEDULABLE,
    pod,
    running,
    terminated,
)

from kvpilot.operator.diagnose import Diagnosis, diagnose

HOUR = 3600
LATE = "2025-12-31T22:00:00Z"  # two hours before NOW


def deployment(progressing: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": "chat-decode"},
            "status": {"conditions": [{"type": "Progressing", **progressing}]}}


CASES: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], Diagnosis | None]] = [
    ("ready", [pod("p0", containers=[running("engine", True)], ready=True, phase="Running")],
     [], None),
    ("loading within the deadline", [pod("p0", containers=[running("engine")],
                                         phase="Running")], [], None),
    ("downloading within the deadline", [pod("p0", init=[running("fetch-model")])], [], None),
    ("unschedulable", [pod("p0", scheduled=UNSCHEDULABLE)], [],
     Diagnosis("Unschedulable", "pod p0: 0/4 nodes are available: 4 Insufficient "
               "nvidia.com/gpu.", "p0")),
    ("image pull", [pod("p0", containers=[PULL])], [],
     Diagnosis("ImagePullFailed", 'pod p0: container engine: ImagePullBackOff: Back-off pulling '
               'image "ghcr.io/kvpilot/engine:0.1.0"', "p0")),
    ("image pull of the init container", [pod("p0", init=[
        {**PULL, "name": "fetch-model"}])], [],
     Diagnosis("ImagePullFailed", 'pod p0: container fetch-model: ImagePullBackOff: Back-off '
               'pulling image "ghcr.io/kvpilot/engine:0.1.0"', "p0")),
    ("weights download failed, retrying", [pod("p0", init=[FETCH_FAILED])], [],
     Diagnosis("WeightsDownloadFailed", "pod p0: kvpilot fetch: error: acme/llama is gated: set "
               "spec.model.secretRef to a Secret", "p0")),
    ("weights download failed, first exit", [pod("p0", init=[terminated("fetch-model", 1)])], [],
     Diagnosis("WeightsDownloadFailed", "pod p0: exit code 1", "p0")),
    ("weights downloaded", [pod("p0", init=[terminated("fetch-model", 0, "Completed")],
                               containers=[running("engine")], phase="Running")], [], None),
    ("oom killed", [pod("p0", containers=[OOM], phase="Running")], [],
     Diagnosis("OOMKilled", "pod p0: container engine was killed for exceeding its memory limit "
               "(restarts: 3); raise the memory limit (overrides.resources.limits.memory) or "
               "lower the load", "p0")),
    ("crash loop", [pod("p0", containers=[CRASH], phase="Running")], [],
     Diagnosis("CrashLoop", "pod p0: container engine keeps exiting (exit code 1, restarts: 4); "
               "kubectl logs p0 -c engine --previous", "p0")),
    ("not ready past the deadline", [pod("p0", containers=[running("engine")],
                                         phase="Running", since=LATE)], [],
     Diagnosis("ProgressDeadlineExceeded", "pod p0 has not been ready for 7320s, past "
               "progressDeadlineSeconds=3600 (phase Running)", "p0")),
    ("deployment past its deadline", [], [deployment({
        "status": "False", "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "chat-decode-5d" has timed out progressing.'})],
     Diagnosis("ProgressDeadlineExceeded", 'Deployment/chat-decode: ReplicaSet "chat-decode-5d" '
               "has timed out progressing.")),
    ("deployment progressing", [], [deployment({"status": "True",
                                                "reason": "ReplicaSetUpdated"})], None),
    ("the worst of several, counting the pods", [
        pod("p2", scheduled=UNSCHEDULABLE), pod("p1", containers=[CRASH], phase="Running"),
        pod("p0", containers=[CRASH], phase="Running"), pod("p3", containers=[PULL])], [],
     Diagnosis("ImagePullFailed", 'pod p3: container engine: ImagePullBackOff: Back-off pulling '
               'image "ghcr.io/kvpilot/engine:0.1.0"', "p3")),
    ("two pods crashing", [pod("p1", containers=[CRASH], phase="Running"),
                           pod("p0", containers=[CRASH], phase="Running")], [],
     Diagnosis("CrashLoop", "pod p0: container engine keeps exiting (exit code 1, restarts: 4); "
               "kubectl logs p0 -c engine --previous (and 1 more pod)", "p0")),
    ("a terminating pod is not a failure", [{**pod("p0", containers=[CRASH]), "metadata": {
        "name": "p0", "deletionTimestamp": "2026-01-01T00:01:00Z"}}], [], None),
]


@pytest.mark.parametrize(("pods", "workloads", "expected"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_diagnose(pods, workloads, expected):
    assert diagnose(pods, workloads, HOUR, NOW) == expected
