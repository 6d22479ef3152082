"""Roll ready counts up: workload -> pool status, pool -> InferenceModel status.

These are event handlers (no kopf state): every change of a child re-derives
the parent's counts and conditions from what the API server holds now, and
patches the parent's status only when it would change.
"""

from __future__ import annotations

from typing import Any

import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.handlers.indexes import every, first
from kvpilot.operator.handlers.inference_model import pool_counts, pool_problems
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.diff import differs
from kvpilot.operator.render.meta import GROUP_VERSION, MANAGED_BY
from kvpilot.operator.render.pool import pool_selector
from kvpilot.operator.render.router import endpoint_url
from kvpilot.operator.status import (
    DEGRADED,
    is_true,
    model_status,
    now_rfc3339,
    own_problem,
    pool_status,
    workload_ready,
)

GROUP, VERSION = GROUP_VERSION.split("/")
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY["app.kubernetes.io/managed-by"]}
POOL_KINDS = ("PrefillPool", "DecodePool")


def controller_of(body: kopf.Body, kinds: tuple[str, ...]) -> dict[str, Any] | None:
    """Gives the owner reference of `body` whose kind is one of `kinds`, if any."""
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") in kinds and ref.get("apiVersion") == GROUP_VERSION:
            return dict(ref)
    return None


async def _patch_status_if_changed(kube: Kube, obj: dict[str, Any],
                                   status: dict[str, Any]) -> None:
    if differs(obj.get("status") or {}, status):
        meta = obj["metadata"]
        await kube.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"],
                         {"status": status}, subresource="status")


def _ready_view(body: kopf.Body) -> dict[str, Any] | None:
    """Gives {pool uid: the workload's kind, size and ready count}, or None if no pool owns it."""
    ref = controller_of(body, POOL_KINDS)
    if ref is None:
        return None
    return {ref["uid"]: {"kind": body["kind"],
                         "spec": {"replicas": (body.get("spec") or {}).get("replicas", 1)},
                         "status": {"readyReplicas":
                                    (body.get("status") or {}).get("readyReplicas", 0)}}}


# In-memory indexes fed by the watch streams: ready counts roll up without listing workloads.
@kopf.index("apps", "v1", "deployments", labels=MANAGED)
async def deployments_by_pool(body: kopf.Body, **_: Any) -> dict[str, Any] | None:
    """Indexes pool-owned Deployments by their pool's uid."""
    return _ready_view(body)


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
async def statefulsets_by_pool(body: kopf.Body, **_: Any) -> dict[str, Any] | None:
    """Indexes pool-owned StatefulSets (multi-node groups) by their pool's uid."""
    return _ready_view(body)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
async def workload_changed(body: kopf.Body, type: str | None, memo: kopf.Memo,
                           deployments_by_pool: kopf.Index, statefulsets_by_pool: kopf.Index,
                           prefill_pools: kopf.Index, decode_pools: kopf.Index,
                           **_: Any) -> None:
    """Recounts the owning pool's ready replicas when one of its workloads changes."""
    ref = controller_of(body, POOL_KINDS)
    if ref is None or type is None:  # router Deployments, and the initial listing
        return
    pool = first(prefill_pools, ("uid", ref["uid"])) or first(decode_pools, ("uid", ref["uid"]))
    if pool is None:
        return  # the pool's own events will count it once it is indexed
    status = pool["status"]
    if is_true(status.get("conditions"), DEGRADED) or "observedGeneration" not in status:
        return  # the pool handler owns the status until the spec is valid and handled
    workloads = [*deployments_by_pool.get(ref["uid"], []),
                 *statefulsets_by_pool.get(ref["uid"], [])]
    new = pool_status(pool["spec"].get("replicas", 1), workload_ready(workloads),
                      pool_selector(pool), status.get("observedGeneration"),
                      status.get("conditions"), now_rfc3339())
    await _patch_status_if_changed(memo.kube, pool, new)


@kopf.on.event(GROUP, VERSION, "prefillpools")
@kopf.on.event(GROUP, VERSION, "decodepools")
async def pool_changed(body: kopf.Body, type: str | None, memo: kopf.Memo,
                       models_by_name: kopf.Index, prefill_pools: kopf.Index,
                       decode_pools: kopf.Index, **_: Any) -> None:
    """Recounts the owning InferenceModel's pools when one of them changes."""
    ref = controller_of(body, ("InferenceModel",))
    if ref is None or type is None:
        return
    namespace = body["metadata"]["namespace"]
    im = first(models_by_name, (namespace, ref["name"]))
    if im is None or im["metadata"]["uid"] != ref["uid"]:
        return
    status = im["status"]
    if own_problem(status.get("conditions")) or "observedGeneration" not in status:
        return  # the model's handler owns the status until its own spec is fixed
    try:
        spec = InferenceModelSpec.model_validate(im["spec"])
    except ValueError:
        return
    pools = every((prefill_pools, decode_pools), ("model", ref["uid"]))
    counts = pool_counts(spec, ref["name"], pools)
    endpoint = endpoint_url(ref["name"], namespace) if spec.router.replicas > 0 else None
    new = model_status(counts, endpoint, status.get("observedGeneration"),
                       status.get("conditions"), now_rfc3339(), pool_problems(pools))
    await _patch_status_if_changed(memo.kube, im, new)
