"""Pod and workload statuses as the kubelet, the scheduler and the controllers write them."""

from __future__ import annotations

from typing import Any

T0 = "2026-01-01T00:00:00Z"
NOW = 1767225600.0 + 120  # two minutes after T0


def pod(name: str, *, init: list[dict[str, Any]] | None = None,
        containers: list[dict[str, Any]] | None = None, scheduled: dict[str, Any] | None = None,
        ready: bool = False, phase: str = "Pending", since: str = T0,
        labels: dict[str, str] | None = None) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False",
                   "lastTransitionTime": since}]
    if scheduled is not None:
        conditions.append({"type": "PodScheduled", **scheduled})
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if init is not None:
        status["initContainerStatuses"] = init
    if containers is not None:
        status["containerStatuses"] = containers
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "creationTimestamp": since, "labels": labels or {}},
            "status": status}


def waiting(name: str, reason: str, message: str = "", restarts: int = 0,
            last: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "ready": False, "restartCount": restarts,
                           "state": {"waiting": {"reason": reason, "message": message}}}
    if last is not None:
        out["lastState"] = {"terminated": last}
    return out


def running(name: str, ready: bool = False) -> dict[str, Any]:
    return {"name": name, "ready": ready, "restartCount": 0,
            "state": {"running": {"startedAt": T0}}}


def terminated(name: str, code: int, reason: str = "Error", message: str = "") -> dict[str, Any]:
    return {"name": name, "ready": False, "restartCount": 0,
            "state": {"terminated": {"exitCode": code, "reason": reason, "message": message}}}


UNSCHEDULABLE = {"status": "False", "reason": "Unschedulable",
                 "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}
PULL = waiting("engine", "ImagePullBackOff",
               'Back-off pulling image "ghcr.io/kvpilot/engine:0.1.0"')
GATED = "kvpilot fetch: error: acme/llama is gated: set spec.model.secretRef to a Secret"
FETCH_FAILED = waiting("fetch-model", "CrashLoopBackOff", restarts=2,
                       last={"exitCode": 2, "reason": "Error", "message": GATED})
OOM = waiting("engine", "CrashLoopBackOff", restarts=3,
              last={"exitCode": 137, "reason": "OOMKilled"})
CRASH = waiting("engine", "CrashLoopBackOff", restarts=4,
                last={"exitCode": 1, "reason": "Error"})
