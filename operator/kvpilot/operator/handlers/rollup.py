"""Roll status up: workloads and pods -> pool status, pools and weights -> InferenceModel status.

These are event handlers (no kopf state): every change of a child re-derives the
parent's counts, reasons and conditions from what the watch streams hold now, patches
the parent's status only when it would change, and posts an Event when its Ready or
Degraded condition changed. handlers/pods.py calls the same refresh functions for pod,
Job and timer events.
"""

from __future__ import annotations

import time
from typing import Any

import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.handlers.events import record_transition
from kvpilot.operator.handlers.indexes import first
from kvpilot.operator.handlers.inference_model import pool_counts, pool_problems
from kvpilot.operator.handlers.observed import Observed
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.diff import differs
from kvpilot.operator.render.meta import GROUP_VERSION, MANAGED_BY
from kvpilot.operator.render.pool import pool_selector
from kvpilot.operator.render.router import endpoint_url
from kvpilot.operator.status import (
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
    old = obj.get("status") or {}
    if differs(old, status):
        meta = obj["metadata"]
        await kube.patch(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"],
                         {"status": status}, subresource="status")
        await record_transition(kube, obj, old.get("conditions"), status.get("conditions", []))


async def refresh_pool(kube: Kube, pool: dict[str, Any], observed: Observed) -> None:
    """Re-derives a pool's replica counts and reasons from its workloads and pods, and patches
    its status when that changed."""
    status = pool["status"]
    if own_problem(status.get("conditions")) or "observedGeneration" not in status:
        return  # the pool handler owns the status until the spec is valid and handled
    workloads = observed.workloads(pool["metadata"]["uid"])
    new = pool_status(pool["spec"].get("replicas", 1), workload_ready(workloads),
                      pool_selector(pool), status.get("observedGeneration"),
                      status.get("conditions"), now_rfc3339(),
                      observed.pool_failure(pool, workloads, time.time()))
    await _patch_status_if_changed(kube, pool, new)


async def refresh_model(kube: Kube, im: dict[str, Any], observed: Observed,
                        percent: int | None = None) -> None:
    """Re-derives an InferenceModel's counts, reasons and weights from its pools, pods and
    weights Job, and patches its status when that changed; `percent` is a download's
    progress read from its log."""
    status = im["status"]
    if own_problem(status.get("conditions")) or "observedGeneration" not in status:
        return  # the model's handler owns the status until its own spec is fixed
    try:
        spec = InferenceModelSpec.model_validate(im["spec"])
    except ValueError:
        return
    meta = im["metadata"]
    pools = observed.model_pools(meta["uid"])
    counts = pool_counts(spec, meta["name"], pools)
    endpoint = endpoint_url(meta["name"], meta["namespace"]) if spec.router.replicas > 0 \
        else None
    weights = observed.weights(im, spec, time.time(), percent)
    new = model_status(counts, endpoint, status.get("observedGeneration"),
                       status.get("conditions"), now_rfc3339(), pool_problems(pools),
                       weights.status if weights else None, weights.problem if weights else None)
    await _patch_status_if_changed(kube, im, new)


def _ready_view(body: kopf.Body) -> dict[str, Any] | None:
    """Gives {pool uid: the workload's kind, name, size, ready count and conditions}, or None
    if no pool owns it."""
    ref = controller_of(body, POOL_KINDS)
    if ref is None:
        return None
    status = body.get("status") or {}
    return {ref["uid"]: {"kind": body["kind"], "metadata": {"name": body["metadata"]["name"]},
                         "spec": {"replicas": (body.get("spec") or {}).get("replicas", 1)},
                         "status": {"readyReplicas": status.get("readyReplicas", 0),
                                    "conditions": status.get("conditions") or []}}}


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
                           **kwargs: Any) -> None:
    """Recounts the owning pool's ready replicas when one of its workloads changes."""
    ref = controller_of(body, POOL_KINDS)
    if ref is None or type is None:  # router Deployments, and the initial listing
        return
    observed = Observed.of(kwargs)
    pool = observed.pool_by_uid(ref["uid"])
    if pool is not None:  # else the pool's own events will count it once it is indexed
        await refresh_pool(memo.kube, pool, observed)


@kopf.on.event(GROUP, VERSION, "prefillpools")
@kopf.on.event(GROUP, VERSION, "decodepools")
async def pool_changed(body: kopf.Body, type: str | None, memo: kopf.Memo,
                       **kwargs: Any) -> None:
    """Recounts the owning InferenceModel's pools when one of them changes."""
    ref = controller_of(body, ("InferenceModel",))
    if ref is None or type is None:
        return
    observed = Observed.of(kwargs)
    im = first(observed.models, (body["metadata"]["namespace"], ref["name"]))
    if im is not None and im["metadata"]["uid"] == ref["uid"]:
        await refresh_model(memo.kube, im, observed)
