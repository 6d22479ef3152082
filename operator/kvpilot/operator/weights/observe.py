"""Where an hf:// model's weights are, from what the API server shows: a pure function.

With a cache (spec.model.cache) the weights Job tells: Complete means the claim holds
them (Cached), Failed means it gave up (Failed, with its pod's last log lines), a running
pod means Downloading. Without one, each engine pod's fetch-model init container does:
running (Downloading), exited non-zero (Failed), done in every pod (Downloaded). The
percent comes from the last progress line of the downloading container's log, which the
caller reads (`tail` names the pod and container) and passes back in; between reads the
last percent seen is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.diagnose import (
    WEIGHTS_DOWNLOAD_FAILED,
    Diagnosis,
    pod_problem,
)
from kvpilot.operator.render.weight_cache import JOB_CONTAINER
from kvpilot.operator.render.weights import FETCH_CONTAINER


@dataclass(frozen=True)
class WeightsView:
    """The model's status.weights, the problem it makes the model Degraded for, and the
    container whose log has the progress line."""

    status: dict[str, Any]
    problem: Diagnosis | None = None
    tail: tuple[str, str] | None = None
    """(pod, container) downloading now."""


def _status(phase: str, message: str, claim: str | None = None,
            progress: int | None = None) -> dict[str, Any]:
    state = f"{phase} {progress}%" if phase == "Downloading" and progress is not None else phase
    out: dict[str, Any] = {"phase": phase, "message": message, "state": state}
    if progress is not None:
        out["progress"] = progress
    if claim is not None:
        out["claim"] = claim
    return out


def _name(obj: Mapping[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("name", "?")


def _condition(obj: Mapping[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def _container(pod: Mapping[str, Any], name: str, init: bool) -> Mapping[str, Any] | None:
    key = "initContainerStatuses" if init else "containerStatuses"
    return next((s for s in (pod.get("status") or {}).get(key) or [] if s.get("name") == name),
                None)


def _exit(status: Mapping[str, Any] | None) -> tuple[int | None, str]:
    """Gives the exit code and last log line of a container's current or last termination."""
    if status is None:
        return None, ""
    ended = (status.get("state") or {}).get("terminated") or \
        (status.get("lastState") or {}).get("terminated")
    if not ended:
        return None, ""
    lines = [line for line in (ended.get("message") or "").splitlines() if line.strip()]
    return ended.get("exitCode"), (lines[-1] if lines else f"exit code {ended.get('exitCode')}")


def _running(status: Mapping[str, Any] | None) -> bool:
    return bool(status and (status.get("state") or {}).get("running"))


def _progress(previous: Mapping[str, Any] | None, percent: int | None) -> int | None:
    if percent is not None:
        return percent
    if previous and previous.get("phase") == "Downloading":
        return previous.get("progress")
    return None


def cache_weights(claim: str, jobs: Sequence[Mapping[str, Any]],
                  job_pods: Sequence[Mapping[str, Any]], previous: Mapping[str, Any] | None,
                  percent: int | None, deadline_seconds: int, now: float) -> WeightsView:
    """Gives the weights of a cache claim from the Jobs that fill it and their pods."""
    if any(_condition(job, "Complete") for job in jobs):
        done = next(job for job in jobs if _condition(job, "Complete"))
        return WeightsView(_status("Cached", f"claim {claim} holds the weights (Job "
                                   f"{_name(done)} complete)", claim, 100))
    pods = sorted(job_pods, key=lambda p: (p.get("metadata") or {}).get("creationTimestamp", ""))
    failed = [p for p in pods if _exit(_container(p, JOB_CONTAINER, False))[0] not in (None, 0)]
    last_error = _exit(_container(failed[-1], JOB_CONTAINER, False))[1] if failed else ""
    if jobs and all(_condition(job, "Failed") for job in jobs):
        detail = last_error or "the Job failed"
        message = f"weights Job {_name(jobs[-1])} gave up: {detail}"
        return WeightsView(_status("Failed", message, claim),
                           Diagnosis(WEIGHTS_DOWNLOAD_FAILED, message, _name(failed[-1])
                                     if failed else None))
    retry = f" (after {len(failed)} failed attempt{'s' if len(failed) > 1 else ''}: " \
            f"{last_error})" if failed else ""
    for pod in reversed(pods):
        if _running(_container(pod, JOB_CONTAINER, False)):
            progress = _progress(previous, percent)
            return WeightsView(_status("Downloading", f"pod {_name(pod)} of the weights Job "
                                       f"fills claim {claim}{retry}", claim, progress),
                               tail=(_name(pod), JOB_CONTAINER))
        problem = pod_problem(pod, deadline_seconds, now)
        if problem is not None:
            message = f"weights Job: {problem.message}"
            return WeightsView(_status("Pending", message, claim),
                               Diagnosis(problem.reason, message, problem.pod))
    started = f"Job {_name(jobs[-1])} has no running pod yet" if jobs else \
        "the weights Job is being created"
    return WeightsView(_status("Pending", f"{started}{retry}", claim))


def pod_weights(pods: Sequence[Mapping[str, Any]], previous: Mapping[str, Any] | None,
                percent: int | None) -> WeightsView:
    """Gives the weights of a model whose engine pods each download their own copy."""
    ordered = sorted(pods, key=_name)
    fetches = [(pod, _container(pod, FETCH_CONTAINER, True)) for pod in ordered]
    for pod, status in fetches:
        code, line = _exit(status)
        if code not in (None, 0) and not _running(status):
            # The pool's condition carries WeightsDownloadFailed; the model reads it there.
            return WeightsView(_status("Failed", f"pod {_name(pod)}: {line}"))
    downloading = [pod for pod, status in fetches if _running(status)]
    if downloading:
        pod = downloading[0]
        others = f" (and {len(downloading) - 1} more pods)" if len(downloading) > 1 else ""
        return WeightsView(_status("Downloading", f"pod {_name(pod)} downloads its own copy"
                                   f"{others}", progress=_progress(previous, percent)),
                           tail=(_name(pod), FETCH_CONTAINER))
    if fetches and all(_exit(status)[0] == 0 for _, status in fetches):
        return WeightsView(_status("Downloaded", f"each of {len(fetches)} pods has its copy"))
    return WeightsView(_status("Pending", "no engine pod has started its download yet"))
