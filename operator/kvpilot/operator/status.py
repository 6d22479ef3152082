"""Status conditions as pure functions: Ready, Progressing and Degraded, Kubernetes-style.

Handlers compute a whole status dict from what they observed and patch it in
one go. `lastTransitionTime` only moves when a condition's status flips, so
`kubectl describe` shows when the object last became (un)ready, not when the
operator last looked.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvpilot.operator.diagnose import REASONS, Diagnosis

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
POOL_DEGRADED = "PoolDegraded"


@dataclass(frozen=True)
class PoolCounts:
    """Desired and ready replicas of one pool."""

    desired: int
    ready: int

    @property
    def text(self) -> str:
        """Gives the printer-column form, e.g. '1/2'."""
        return f"{self.ready}/{self.desired}"


def now_rfc3339(at: float | None = None) -> str:
    """Gives the UTC time `at` (epoch seconds; now when None) in conditions' RFC 3339 form."""
    moment = datetime.datetime.now(tz=datetime.UTC) if at is None else \
        datetime.datetime.fromtimestamp(at, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, status: bool | None, reason: str, message: str,
              generation: int | None, now: str) -> dict[str, Any]:
    """Gives one condition dict; `status` None means Unknown."""
    text = "Unknown" if status is None else ("True" if status else "False")
    return {"type": kind, "status": text, "reason": reason, "message": message,
            "lastTransitionTime": now, "observedGeneration": generation}


def merge_conditions(old: Sequence[dict[str, Any]] | None,
                     new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Gives `new` with each condition's lastTransitionTime kept from `old` when its status held."""
    previous = {c.get("type"): c for c in old or ()}
    merged: list[dict[str, Any]] = []
    for cond in new:
        before = previous.get(cond["type"])
        if before and before.get("status") == cond["status"] and before.get("lastTransitionTime"):
            cond = {**cond, "lastTransitionTime": before["lastTransitionTime"]}
        merged.append(cond)
    return merged


def rollout_conditions(pools: dict[str, PoolCounts], generation: int | None,
                       now: str) -> list[dict[str, Any]]:
    """Gives Ready/Progressing/Degraded for a valid spec from its pools' replica counts."""
    waiting = {name: c for name, c in pools.items() if c.ready < c.desired}
    if not waiting:
        ready = condition(READY, True, "AllReplicasReady",
                          _summary(pools) or "no replicas asked for", generation, now)
        progressing = condition(PROGRESSING, False, "RolloutComplete",
                                "every pool has its desired replicas ready", generation, now)
    else:
        message = "waiting for " + ", ".join(
            f"{name} {c.ready}/{c.desired} ready" for name, c in sorted(waiting.items()))
        ready = condition(READY, False, "ReplicasNotReady", message, generation, now)
        progressing = condition(PROGRESSING, True, "RollingOut", message, generation, now)
    degraded = condition(DEGRADED, False, "SpecValid", "the spec planned and rendered",
                         generation, now)
    return [ready, progressing, degraded]


def invalid_spec_conditions(reason: str, message: str, generation: int | None,
                            now: str) -> list[dict[str, Any]]:
    """Gives the conditions of a spec the operator cannot plan: Degraded with the cause."""
    return [
        condition(READY, False, reason, message, generation, now),
        condition(PROGRESSING, False, reason, "nothing rolls out until the spec is fixed",
                  generation, now),
        condition(DEGRADED, True, reason, message, generation, now),
    ]


def failing_conditions(problem: Diagnosis, generation: int | None,
                       now: str) -> list[dict[str, Any]]:
    """Gives the conditions of a valid spec whose replicas fail (diagnose.REASONS): Degraded,
    with the reason and the pod on every condition, so REASON and Argo CD show it."""
    return [
        condition(READY, False, problem.reason, problem.message, generation, now),
        condition(PROGRESSING, False, problem.reason, "stalled: " + problem.message,
                  generation, now),
        condition(DEGRADED, True, problem.reason, problem.message, generation, now),
    ]


def own_problem(conditions: Sequence[dict[str, Any]] | None) -> bool:
    """Gives whether the object is Degraded for its own spec (InvalidSpec, ApplyRejected), not
    for a pool's or for failing replicas: the reconcile handler owns such a status."""
    return any(c.get("type") == DEGRADED and c.get("status") == "True"
               and c.get("reason") not in (POOL_DEGRADED, *REASONS) for c in conditions or ())


def problem(conditions: Sequence[dict[str, Any]] | None) -> Diagnosis | None:
    """Gives the Degraded reason and message when condition Degraded is True, else None."""
    for c in conditions or ():
        if c.get("type") == DEGRADED and c.get("status") == "True":
            reason = str(c.get("reason") or DEGRADED)
            return Diagnosis(reason, str(c.get("message") or reason))
    return None


def transition_event(old: Sequence[dict[str, Any]] | None,
                     new: Sequence[dict[str, Any]]) -> tuple[str, str, bool] | None:
    """Gives the Event (reason, message, warning) for a change of Ready or Degraded between two
    condition lists, or None when neither changed status or reason."""
    def state(conditions: Sequence[dict[str, Any]] | None) -> dict[str, tuple[str, str, str]]:
        return {c["type"]: (c.get("status", ""), c.get("reason", ""), c.get("message", ""))
                for c in conditions or () if c.get("type") in (READY, DEGRADED)}

    before, after = state(old), state(new)
    if {k: v[:2] for k, v in before.items()} == {k: v[:2] for k, v in after.items()}:
        return None
    degraded, ready = after.get(DEGRADED), after.get(READY)
    if degraded and degraded[0] == "True":
        return degraded[1], degraded[2], True
    was = before.get(DEGRADED)
    if was and was[0] == "True" and ready:
        return "Recovered", f"no longer {was[1]}: {ready[2]}", False
    if ready:
        return ("Ready" if ready[0] == "True" else "NotReady"), ready[2], False
    return None


def _summary(pools: dict[str, PoolCounts]) -> str:
    return ", ".join(f"{name} {c.text} ready" for name, c in sorted(pools.items()))


def workload_ready(workloads: Sequence[dict[str, Any]]) -> int:
    """Gives ready engine replicas of a pool from its Deployment, StatefulSet groups or LWS."""
    ready = 0
    for obj in workloads:
        status, spec = obj.get("status") or {}, obj.get("spec") or {}
        if obj.get("kind") == "StatefulSet":
            # One StatefulSet is one multi-node replica: ready only when every rank is.
            size = spec.get("replicas", 1)
            ready += int(size > 0 and status.get("readyReplicas", 0) >= size)
        else:
            ready += int(status.get("readyReplicas", 0))
    return ready


def pool_status(desired: int, ready: int, selector: str, generation: int | None,
                old_conditions: Sequence[dict[str, Any]] | None, now: str,
                failure: Diagnosis | None = None) -> dict[str, Any]:
    """Gives a valid pool's status: scale-subresource fields and conditions, from the rollout
    counts, or from `failure` (diagnose.diagnose) while replicas are missing."""
    counts = {"replicas": PoolCounts(desired, ready)}
    conditions = rollout_conditions(counts, generation, now)
    if failure is not None and ready < desired:
        conditions = failing_conditions(failure, generation, now)
    return {"replicas": desired, "readyReplicas": ready, "selector": selector,
            "conditions": merge_conditions(old_conditions, conditions)}


def model_status(pools: dict[str, PoolCounts], endpoint: str | None, generation: int | None,
                 old_conditions: Sequence[dict[str, Any]] | None, now: str,
                 pool_problems: dict[str, Diagnosis] | None = None,
                 weights: dict[str, Any] | None = None,
                 weights_problem: Diagnosis | None = None) -> dict[str, Any]:
    """Gives a valid InferenceModel's status from its pools' counts ('prefill', 'decode').

    `pool_problems` maps a pool's name to its Degraded reason and message; any makes the
    model Degraded: with the pool's reason when its replicas fail (Unschedulable, ...),
    else PoolDegraded (the pool's own spec). A `weights_problem` (the weights Job) comes
    first. `weights` is status.weights (None: the source has none).
    """
    conditions = rollout_conditions(pools, generation, now)
    if pool_problems:
        message = "; ".join(f"{name}: {p.message}" for name, p in sorted(pool_problems.items()))
        first = pool_problems[min(pool_problems)]
        if first.reason in REASONS:
            conditions = failing_conditions(Diagnosis(first.reason, message), generation, now)
        else:
            conditions = invalid_spec_conditions(POOL_DEGRADED, message, generation, now)
    if weights_problem is not None:
        conditions = failing_conditions(weights_problem, generation, now)
    status: dict[str, Any] = {
        "conditions": merge_conditions(old_conditions, conditions),
        "endpoint": endpoint,
        "weights": weights,
    }
    for role in ("prefill", "decode"):
        counts = pools.get(role)
        status[role] = {"desired": counts.desired, "ready": counts.ready} if counts else None
        status[f"{role}Replicas"] = counts.text if counts else None
    return status


def describe_error(exc: Exception) -> str:
    """Gives a one-line message for a spec error, naming the field (pydantic loc) when known."""
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()))
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
        return "; ".join(parts)
    return str(exc)
