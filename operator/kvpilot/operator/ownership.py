"""Who writes which fields of the operator's children: the field managers, and pool replicas.

Every child is written by server-side apply, so the API server records an owner per field:

- `kvpilot` (the reconcilers) owns every field it renders. Fields it stops rendering are
  removed; fields other writers add (annotations, tolerations a policy engine injects, ...)
  are theirs and stay. When another writer changed one of kvpilot's fields, the apply is
  refused with a conflict; the reconciler reports it (Event, `status.fieldConflicts`) and
  applies again with force, because the field is kvpilot's by construction.
- a pool's `spec.replicas` belongs to whoever its `autoscaling.mode` names (`replicas_owner`):
  the reconciler, from the InferenceModel (no autoscaling block: static replicas); kvpilot's
  autoscaler (`kvpilot-autoscaler`, mode kvpilot); or an HPA / KEDA ScaledObject on the
  pool's scale subresource (mode external). In the last two the reconciler leaves replicas
  out of what it applies, and `kvpilot-handover` holds the starting count (at creation, or
  the count at a switch from static) until the autoscaler writes its own: the handover the
  Kubernetes server-side apply documentation describes for HPA. The handover never forces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvpilot.operator.api.autoscaling import AutoscalingSpec
from kvpilot.operator.kube.client import FIELD_MANAGER
from kvpilot.operator.kube.diff import without
from kvpilot.operator.kube.errors import Conflict

AUTOSCALER_MANAGER = "kvpilot-autoscaler"
HANDOVER_MANAGER = "kvpilot-handover"
OWN_MANAGERS = frozenset({FIELD_MANAGER, AUTOSCALER_MANAGER, HANDOVER_MANAGER})
"""kvpilot's own managers: taking a field from one of them is a handover, not drift."""
REPLICAS = ("spec", "replicas")

ReplicasOwner = Literal["kvpilot", "kvpilot-autoscaler", "external"]


def replicas_owner(autoscaling: AutoscalingSpec | None) -> ReplicasOwner:
    """Gives who writes a pool's spec.replicas under its autoscaling block (None: static)."""
    if autoscaling is None:
        return "kvpilot"
    return "kvpilot-autoscaler" if autoscaling.mode == "kvpilot" else "external"


@dataclass(frozen=True)
class PoolApply:
    """How the reconciler writes one pool: what it applies, and the replicas handover."""

    body: dict[str, Any]
    """What `kvpilot` applies."""
    handover: dict[str, Any] | None = None
    """What `kvpilot-handover` applies (only spec.replicas), never forced; None: nothing."""
    handover_first: bool = True
    """Apply the handover before `body` (the pool exists), else after it (it is created)."""


def pool_apply(pool: Mapping[str, Any], owner: ReplicasOwner,
               stored_replicas: int | None) -> PoolApply:
    """Gives how to write a rendered pool whose replicas belong to `owner`, given the replicas
    the stored pool has (None: there is no stored pool yet).

    A new pool is created with its starting replicas, which the handover then holds; an
    existing one is applied without replicas after the handover took the stored count, so
    kvpilot letting go of the field (a switch from static) never removes it.
    """
    if owner == "kvpilot":
        return PoolApply(dict(pool))
    if stored_replicas is None:
        return PoolApply(dict(pool), replicas_only(pool, pool["spec"]["replicas"]),
                         handover_first=False)
    return PoolApply(without(pool, [REPLICAS]), replicas_only(pool, stored_replicas))


def replicas_only(pool: Mapping[str, Any], replicas: int) -> dict[str, Any]:
    """Gives the apply body that sets only a pool's spec.replicas (handover, autoscaler)."""
    meta = pool["metadata"]
    return {"apiVersion": pool["apiVersion"], "kind": pool["kind"],
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": {"replicas": replicas}}


def foreign(conflicts: list[Conflict]) -> list[Conflict]:
    """Gives the conflicts with writers other than kvpilot's own managers (drift to report)."""
    return [c for c in conflicts if c.manager not in OWN_MANAGERS]


def conflict_message(kind: str, name: str, conflicts: list[Conflict]) -> str:
    """Gives the Event message for fields kvpilot took back on `kind/name`."""
    fields = ", ".join(f"{c.field} (set by {c.manager!r})" for c in conflicts)
    hint = ""
    if kind in ("PrefillPool", "DecodePool") and any(c.field == ".spec.replicas"
                                                     for c in conflicts):
        hint = ("; if an HPA or KEDA scales this pool, set autoscaling.mode: external on its "
                "InferenceModel template so kvpilot leaves replicas to it")
    return f"{kind}/{name}: {fields}: kvpilot owns these fields and applied its values{hint}"
