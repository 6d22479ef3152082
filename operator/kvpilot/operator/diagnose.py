"""Why a pool's replicas are not ready, read from its pods and workloads: a pure function.

The reasons, most severe first (the first found names the pool's condition):

| reason                   | seen as                                                             |
|--------------------------|---------------------------------------------------------------------|
| WeightsDownloadFailed    | the fetch-model init container exited non-zero (its last log lines) |
| ImagePullFailed          | a container waiting in ErrImagePull, ImagePullBackOff, ...          |
| OOMKilled                | a container's last or current termination says OOMKilled            |
| CrashLoop                | a container waiting in CrashLoopBackOff (its exit code)             |
| Unschedulable            | PodScheduled=False, reason Unschedulable (the scheduler's message)  |
| ProgressDeadlineExceeded | the Deployment says so, or a pod stayed not ready past the deadline |

Only what the API server shows is used: pod and container states, conditions and
termination messages, never logs or node access.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.render.weights import FETCH_CONTAINER

WEIGHTS_DOWNLOAD_FAILED = "WeightsDownloadFailed"
IMAGE_PULL_FAILED = "ImagePullFailed"
OOM_KILLED = "OOMKilled"
CRASH_LOOP = "CrashLoop"
UNSCHEDULABLE = "Unschedulable"
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
REASONS = (WEIGHTS_DOWNLOAD_FAILED, IMAGE_PULL_FAILED, OOM_KILLED, CRASH_LOOP, UNSCHEDULABLE,
           PROGRESS_DEADLINE_EXCEEDED)
"""Every reason, most severe first."""
IMAGE_PULL_WAITING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
MESSAGE_LIMIT = 600


@dataclass(frozen=True)
class Diagnosis:
    """One reason a replica is not ready: the reason, what was seen, and the pod."""

    reason: str
    message: str
    pod: str | None = None


def parse_time(text: str | None) -> float | None:
    """Gives epoch seconds of an RFC 3339 time as the API server writes it, or None."""
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _last_lines(text: str | None, lines: int = 3) -> str:
    kept = [line for line in (text or "").strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-MESSAGE_LIMIT:]


def _terminated(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Gives the current termination of a container, else its last one, else None."""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    return state.get("terminated") or last.get("terminated")


def _container_problem(pod: str, status: Mapping[str, Any], init: bool) -> Diagnosis | None:
    name = status.get("name", "?")
    waiting = (status.get("state") or {}).get("waiting") or {}
    ended = _terminated(status)
    restarts = status.get("restartCount", 0)
    if waiting.get("reason") in IMAGE_PULL_WAITING:
        return Diagnosis(IMAGE_PULL_FAILED, f"pod {pod}: container {name}: {waiting['reason']}: "
                         f"{waiting.get('message', '')}".rstrip(": ")[:MESSAGE_LIMIT], pod)
    if init and name == FETCH_CONTAINER and ended and ended.get("exitCode", 0) != 0:
        detail = _last_lines(ended.get("message")) or f"exit code {ended.get('exitCode')}"
        return Diagnosis(WEIGHTS_DOWNLOAD_FAILED, f"pod {pod}: {detail}", pod)
    if ended and ended.get("reason") == "OOMKilled":
        return Diagnosis(OOM_KILLED, f"pod {pod}: container {name} was killed for exceeding its "
                         f"memory limit (restarts: {restarts}); raise the memory limit "
                         "(overrides.resources.limits.memory) or lower the load", pod)
    if waiting.get("reason") == "CrashLoopBackOff":
        code = ended.get("exitCode") if ended else None
        detail = _last_lines(ended.get("message")) if ended else ""
        return Diagnosis(CRASH_LOOP, f"pod {pod}: container {name} keeps exiting (exit code "
                         f"{code}, restarts: {restarts}){': ' + detail if detail else ''}; "
                         f"kubectl logs {pod} -c {name} --previous", pod)
    return None


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def pod_problem(pod: Mapping[str, Any], deadline_seconds: int, now: float) -> Diagnosis | None:
    """Gives the most severe reason one pod is not ready, or None when it is ready or merely
    on its way (inside the deadline)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None  # leaving: a rollout or scale-down, not a failure
    name = meta.get("name", "?")
    found = [problem for init, key in ((True, "initContainerStatuses"),
                                       (False, "containerStatuses"))
             for s in status.get(key) or []
             if (problem := _container_problem(name, s, init)) is not None]
    scheduled = _condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False" and \
            scheduled.get("reason") == "Unschedulable":
        found.append(Diagnosis(UNSCHEDULABLE, f"pod {name}: {scheduled.get('message', '')}"
                               .rstrip(": ")[:MESSAGE_LIMIT], name))
    if found:
        return min(found, key=lambda d: REASONS.index(d.reason))
    ready = _condition(pod, "Ready")
    if ready and ready.get("status") == "True":
        return None
    since = parse_time((ready or {}).get("lastTransitionTime")) or \
        parse_time(meta.get("creationTimestamp"))
    if since is not None and now - since > deadline_seconds:
        return Diagnosis(PROGRESS_DEADLINE_EXCEEDED, f"pod {name} has not been ready for "
                         f"{int(now - since)}s, past progressDeadlineSeconds="
                         f"{deadline_seconds} (phase {status.get('phase', '?')})", name)
    return None


def _workload_problem(workload: Mapping[str, Any]) -> Diagnosis | None:
    progressing = _condition(workload, "Progressing")
    if progressing and progressing.get("status") == "False" and \
            progressing.get("reason") == PROGRESS_DEADLINE_EXCEEDED:
        name = f"{workload.get('kind', '?')}/{(workload.get('metadata') or {}).get('name', '?')}"
        return Diagnosis(PROGRESS_DEADLINE_EXCEEDED,
                         f"{name}: {progressing.get('message', '')}".rstrip(": "))
    return None


def diagnose(pods: Sequence[Mapping[str, Any]], workloads: Sequence[Mapping[str, Any]],
             deadline_seconds: int, now: float) -> Diagnosis | None:
    """Gives the most severe reason a pool's replicas are not ready (its pods first, then its
    workloads), naming how many pods share it; None when nothing is wrong."""
    ordered = sorted(pods, key=lambda p: (p.get("metadata") or {}).get("name", ""))
    found = [d for pod in ordered if (d := pod_problem(pod, deadline_seconds, now)) is not None]
    found += [d for w in workloads if (d := _workload_problem(w)) is not None]
    if not found:
        return None
    worst = min(found, key=lambda d: REASONS.index(d.reason))
    others = sum(1 for d in found if d.reason == worst.reason and d.pod and d.pod != worst.pod)
    if others:
        return Diagnosis(worst.reason, f"{worst.message} (and {others} more pod"
                         f"{'s' if others > 1 else ''})", worst.pod)
    return worst
