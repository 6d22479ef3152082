"""InferenceModel handlers: render and apply its pools, router and ConfigMap; write its status."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
import kopf

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.names import pool_name
from kvpilot.operator.handlers.children import sync_children
from kvpilot.operator.handlers.fleet import ensure_fleet_secret
from kvpilot.operator.handlers.rejection import reject, reject_apply_error
from kvpilot.operator.handlers.worker import off_loop
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.render.children import pool_specs, render_model
from kvpilot.operator.render.meta import GROUP_VERSION, MODEL_LABEL
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
    ("networking.k8s.io/v1", "NetworkPolicy"),
]
POOL_ROLES = {"PrefillPool": "prefill", "DecodePool": "decode"}


def pool_problems(pools: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Gives {pool name: Degraded message} of the pools that are Degraded."""
    out: dict[str, str] = {}
    for pool in pools:
        message = problem((pool.get("status") or {}).get("conditions"))
        if message is not None:
            out[pool["metadata"]["name"]] = message
    return out


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
                          reason: str, **_: Any) -> None:
    """Brings an InferenceModel's children to its spec and writes its status."""
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    kube: Kube = memo.kube
    now = now_rfc3339()
    im = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(meta)}
    try:
        rendered = await off_loop(render_model, im, dict(spec), memo.render)
    except ValueError as exc:
        await reject(kube, im, patch, status, "InvalidSpec", describe_error(exc), now)
        return
    parsed, pools, children = rendered.spec, rendered.pools, rendered.children
    autoscaled = {pool.name: [("spec", "replicas")] for pool in pools
                  if pool.spec.autoscaling is not None}
    try:
        await ensure_fleet_secret(kube, name, namespace, im)
        # A new object has nothing stale to remove.
        stored = await sync_children(kube, im, children, OWNED_KINDS, {MODEL_LABEL: name},
                                     prune_stale=reason != "create", keep=autoscaled)
    except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
        await reject_apply_error(exc, kube, im, patch, status, now)
        return
    counts = pool_counts(parsed, name, stored)
    endpoint = endpoint_url(name, namespace) if parsed.router.replicas > 0 else None
    pools = [o for o in stored if o.get("kind") in POOL_ROLES]
    patch.status.update(model_status(counts, endpoint, generation, status.get("conditions"), now,
                                     pool_problems(pools)))
    patch.status["observedGeneration"] = generation
