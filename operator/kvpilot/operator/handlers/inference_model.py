"""InferenceModel handlers: render and apply its pools, router and ConfigMap; write its status."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.diagnose import Diagnosis
from kvpilot.operator.handlers.children import field_conflicts, sync_children
from kvpilot.operator.handlers.events import record_transition
from kvpilot.operator.handlers.observed import Observed
from kvpilot.operator.handlers.rejection import reject, reject_apply_error
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.ownership import PoolApply, pool_apply, replicas_owner
from kvpilot.operator.render.children import (
    OwnedPool,
    owned_pools,
    pool_name,
    pool_specs,
    render_children,
)
from kvpilot.operator.render.gateway import INFERENCE_POOL_API
from kvpilot.operator.render.meta import GROUP_VERSION, MODEL_LABEL, RenderConfig
from kvpilot.operator.render.router import endpoint_url
from kvpilot.operator.status import (
    PoolCounts,
    describe_error,
    model_status,
    now_rfc3339,
    problem,
)

GROUP, VERSION = GROUP_VERSION.split("/")
OWNED_KINDS = [
    (GROUP_VERSION, "PrefillPool"), (GROUP_VERSION, "DecodePool"), ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"), ("v1", "Service"), ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "PersistentVolumeClaim"), ("batch/v1", "Job"),
]


def owned_kinds(config: RenderConfig) -> list[tuple[str, str]]:
    """Gives the (apiVersion, kind) an InferenceModel may own under `config`."""
    return [*OWNED_KINDS, *([(INFERENCE_POOL_API, "InferencePool")]
                            if config.inference_pool else [])]


POOL_ROLES = {"PrefillPool": "prefill", "DecodePool": "decode"}


def pool_problems(pools: Iterable[Mapping[str, Any]]) -> dict[str, Diagnosis]:
    """Gives {pool name: Degraded reason and message} of the pools that are Degraded."""
    out: dict[str, Diagnosis] = {}
    for pool in pools:
        found = problem((pool.get("status") or {}).get("conditions"))
        if found is not None:
            out[pool["metadata"]["name"]] = found
    return out


def pool_writes(pools: Iterable[OwnedPool], rendered: Iterable[Mapping[str, Any]],
                stored: Iterable[Mapping[str, Any]]) -> dict[str, PoolApply]:
    """Gives how to write each rendered pool: who owns its replicas decides whether kvpilot
    applies them, and the replicas the stored pools have (from the index) feed the handover."""
    by_name = {o["metadata"]["name"]: o for o in rendered}
    replicas = {p["metadata"]["name"]: (p.get("spec") or {}).get("replicas") for p in stored}
    return {pool.name: pool_apply(by_name[pool.name], replicas_owner(pool.spec.autoscaling),
                                  replicas.get(pool.name))
            for pool in pools}


def pool_counts(spec: InferenceModelSpec, model: str,
                pools: Iterable[Mapping[str, Any]]) -> dict[str, PoolCounts]:
    """Gives desired/ready replicas per role ('prefill', 'decode') from the pools as stored."""
    stored = {(p.get("kind"), p.get("metadata", {}).get("name")): p for p in pools}
    counts: dict[str, PoolCounts] = {}
    for pool in pool_specs(spec, model):
        role = POOL_ROLES[pool.kind]
        current = stored.get((pool.kind, pool_name(model, role)))
        if current is None:
            counts[role] = PoolCounts(pool.replicas, 0)
            continue
        counts[role] = PoolCounts(int((current.get("spec") or {}).get("replicas", pool.replicas)),
                                  int((current.get("status") or {}).get("readyReplicas", 0)))
    return counts


@kopf.on.resume(GROUP, VERSION, "inferencemodels")
@kopf.on.create(GROUP, VERSION, "inferencemodels")
@kopf.on.update(GROUP, VERSION, "inferencemodels")
async def reconcile_model(body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec,
                          status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo,
                          reason: str, **kwargs: Any) -> None:
    """Brings an InferenceModel's children to its spec and writes its status."""
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    kube: Kube = memo.kube
    now = now_rfc3339()
    observed = Observed.of(kwargs)
    im = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(meta)}
    try:
        parsed = InferenceModelSpec.model_validate(dict(spec))
        pools = owned_pools(parsed, name)
        children = render_children(im, parsed, pools, memo.render)
    except ValueError as exc:
        await reject(kube, im, patch, status, "InvalidSpec", describe_error(exc), now)
        return
    indexed = observed.model_pools(meta["uid"])
    writes = pool_writes(pools, children, indexed)
    try:
        # A new object has nothing stale to remove.
        applied = await sync_children(kube, im, children, owned_kinds(memo.render),
                                      {MODEL_LABEL: name},
                                      prune_stale=reason != "create", pools=writes)
    except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
        await reject_apply_error(exc, kube, im, patch, status, now)
        return
    applied_pools = [o for o in applied.stored if o.get("kind") in POOL_ROLES]
    # The index follows the pools' watch events, so its statuses may be newer than the apply's
    # answers; the roll-up skips this model until its first status is written.
    names = {p["metadata"]["name"] for p in applied_pools}
    fresh = [p for p in observed.model_pools(meta["uid"]) if p["metadata"]["name"] in names]
    pools = fresh if len(fresh) == len(names) else applied_pools
    counts = pool_counts(parsed, name, pools)
    endpoint = endpoint_url(name, namespace) if parsed.router.replicas > 0 else None
    weights = observed.weights({**im, "status": dict(status)}, parsed, time.time())
    new = model_status(counts, endpoint, generation, status.get("conditions"), now,
                       pool_problems(pools), weights.status if weights else None,
                       weights.problem if weights else None)
    await record_transition(kube, im, status.get("conditions"), new["conditions"])
    patch.status.update(new)
    patch.status["observedGeneration"] = generation
    conflicts = field_conflicts(applied.conflicts)
    if conflicts or status.get("fieldConflicts"):
        patch.status["fieldConflicts"] = conflicts or None
