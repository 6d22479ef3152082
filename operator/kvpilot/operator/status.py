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


def is_true(conditions: Sequence[dict[str, Any]] | None, kind: str) -> bool:
    """Gives whether condition `kind` is present with status True."""
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions or ())


def own_problem(conditions: Sequence[dict[str, Any]] | None) -> bool:
    """Gives whether the object is Degraded for its own spec (not for a pool's)."""
    return any(c.get("type") == DEGRADED and c.get("status") == "True"
               and c.get("reason") != POOL_DEGRADED for c in conditions or ())


def problem(conditions: Sequence[dict[str, Any]] | None) -> str | None:
    """Gives the Degraded message when condition Degraded is True, else None."""
    for c in conditions or ():
        if c.get("type") == DEGRADED and c.get("status") == "True":
            return str(c.get("message") or c.get("reason") or "degraded")
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
                old_conditions: Sequence[dict[str, Any]] | None, now: str) -> dict[str, Any]:
    """Gives a valid pool's status: scale-subresource fields and rollout conditions."""
    counts = {"replicas": PoolCounts(desired, ready)}
    return {"replicas": desired, "readyReplicas": ready, "selector": selector,
            "conditions": merge_conditions(old_conditions,
                                           rollout_conditions(counts, generation, now))}


def model_status(pools: dict[str, PoolCounts], endpoint: str | None, generation: int | None,
                 old_conditions: Sequence[dict[str, Any]] | None, now: str,
                 pool_problems: dict[str, str] | None = None) -> dict[str, Any]:
    """Gives a valid InferenceModel's status from its pools' counts ('prefill', 'decode').

    `pool_problems` maps a pool's name to its Degraded message; any makes the model
    Degraded with reason PoolDegraded (the model's own spec is fine, a pool's is not).
    """
    conditions = rollout_conditions(pools, generation, now)
    if pool_problems:
        message = "; ".join(f"{name}: {text}" for name, text in sorted(pool_problems.items()))
        conditions = invalid_spec_conditions(POOL_DEGRADED, message, generation, now)
    status: dict[str, Any] = {
        "conditions": merge_conditions(old_conditions, conditions),
        "endpoint": endpoint,
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
