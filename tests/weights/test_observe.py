"""Where the weights are, from the weights Job, its pods and the engine pods: a table."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.pod_states import (
    NOW,
    T0,
    UNSCHEDULABLE,
    pod,
    running,
    terminated,
    waiting,
)

from kvpilot.operator.diagnose import Diagnosis
from kvpilot.operator.weights.observe import cache_weights, pod_weights

CLAIM = "chat-weights-1a2b3c"
ERROR = "kvpilot fetch: error: downloading acme/x@main failed: timed out; the next attempt resumes"


def job(*conditions: str, name: str = "chat-weights-1a2b3c-9f8e7d") -> dict[str, Any]:
    return {"kind": "Job", "metadata": {"name": name},
            "status": {"conditions": [{"type": c, "status": "True"} for c in conditions]}}


def job_pod(name: str, container: dict[str, Any], created: str = T0,
            **kwargs: Any) -> dict[str, Any]:
    out = pod(name, containers=[container], **kwargs)
    out["metadata"]["creationTimestamp"] = created
    return out


FAILED_POD = job_pod("j-1", terminated("fetch-model", 1, message=ERROR), phase="Failed")


@pytest.mark.parametrize(("jobs", "pods", "previous", "percent", "status", "problem", "tail"), [
    ([], [], None, None, {"phase": "Pending", "state": "Pending", "claim": CLAIM,
                          "message": "the weights Job is being created"}, None, None),
    ([job()], [], None, None,
     {"phase": "Pending", "state": "Pending", "claim": CLAIM,
      "message": "Job chat-weights-1a2b3c-9f8e7d has no running pod yet"}, None, None),
    ([job()], [job_pod("j-0", running("fetch-model"))], None, 42,
     {"phase": "Downloading", "state": "Downloading 42%", "progress": 42, "claim": CLAIM,
      "message": f"pod j-0 of the weights Job fills claim {CLAIM}"}, None, ("j-0", "fetch-model")),
    ([job()], [job_pod("j-0", running("fetch-model"))], {"phase": "Downloading", "progress": 40},
     None, {"phase": "Downloading", "state": "Downloading 40%", "progress": 40, "claim": CLAIM,
            "message": f"pod j-0 of the weights Job fills claim {CLAIM}"}, None,
     ("j-0", "fetch-model")),
    ([job()], [FAILED_POD, job_pod("j-2", running("fetch-model"), "2026-01-01T00:01:00Z")],
     None, None, {"phase": "Downloading", "state": "Downloading", "claim": CLAIM,
                  "message": f"pod j-2 of the weights Job fills claim {CLAIM} (after 1 failed "
                             f"attempt: {ERROR})"}, None, ("j-2", "fetch-model")),
    ([job("Failed")], [FAILED_POD], None, None,
     {"phase": "Failed", "state": "Failed", "claim": CLAIM,
      "message": f"weights Job chat-weights-1a2b3c-9f8e7d gave up: {ERROR}"},
     Diagnosis("WeightsDownloadFailed", f"weights Job chat-weights-1a2b3c-9f8e7d gave up: "
               f"{ERROR}", "j-1"), None),
    ([job()], [job_pod("j-0", waiting("fetch-model", "ContainerCreating"),
                       scheduled=UNSCHEDULABLE)], None, None,
     {"phase": "Pending", "state": "Pending", "claim": CLAIM,
      "message": "weights Job: pod j-0: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu."},
     Diagnosis("Unschedulable", "weights Job: pod j-0: 0/4 nodes are available: 4 "
               "Insufficient nvidia.com/gpu.", "j-0"), None),
    ([job("Complete"), job("Failed", name="old")], [], {"phase": "Downloading"}, None,
     {"phase": "Cached", "state": "Cached", "progress": 100, "claim": CLAIM,
      "message": f"claim {CLAIM} holds the weights (Job chat-weights-1a2b3c-9f8e7d complete)"},
     None, None),
], ids=["no-job", "no-pod", "downloading", "keeps-last-percent", "retrying", "failed",
        "job-pod-unschedulable", "cached"])
def test_cache_weights(jobs, pods, previous, percent, status, problem, tail):
    view = cache_weights(CLAIM, jobs, pods, previous, percent, 3600, NOW)
    assert (view.status, view.problem, view.tail) == (status, problem, tail)


GATED = "kvpilot fetch: error: acme/x is gated: set spec.model.secretRef"


@pytest.mark.parametrize(("pods", "status", "tail"), [
    ([], {"phase": "Pending", "state": "Pending",
          "message": "no engine pod has started its download yet"}, None),
    ([pod("p1", init=[running("fetch-model")]), pod("p0", init=[running("fetch-model")])],
     {"phase": "Downloading", "state": "Downloading 7%", "progress": 7,
      "message": "pod p0 downloads its own copy (and 1 more pods)"}, ("p0", "fetch-model")),
    ([pod("p0", init=[terminated("fetch-model", 0, "Completed")]),
      pod("p1", init=[terminated("fetch-model", 0, "Completed")])],
     {"phase": "Downloaded", "state": "Downloaded", "message": "each of 2 pods has its copy"},
     None),
    ([pod("p0", init=[waiting("fetch-model", "CrashLoopBackOff", last={
        "exitCode": 2, "message": GATED})])],
     {"phase": "Failed", "state": "Failed", "message": f"pod p0: {GATED}"}, None),
], ids=["no-pods", "downloading", "downloaded", "failed"])
def test_pod_weights(pods, status, tail):
    view = pod_weights(pods, None, 7 if tail else None)
    assert (view.status, view.problem, view.tail) == (status, None, tail)
