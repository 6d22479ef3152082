"""PrefillPool and DecodePool handlers: render and apply workloads, Services and PDB; write status."""

from __future__ import annotations

from typing import Any

import aiohttp
import kopf

from kvpilot.operator.handlers.children import sync_children
from kvpilot.operator.handlers.fleet import ensure_fleet_secret
from kvpilot.operator.handlers.rejection import reject, reject_apply_error
from kvpilot.operator.handlers.resolve import resolve_stored_pool
from kvpilot.operator.handlers.worker import off_loop
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.render.meta import GROUP_VERSION, POOL_LABEL, RenderConfig
from kvpilot.operator.render.pool import pool_selector, render_pool
from kvpilot.operator.render.workloads import LWS_API_VERSION
from kvpilot.operator.status import (
    describe_error,
    now_rfc3339,
    pool_status,
    workload_ready,
)

GROUP, VERSION = GROUP_VERSION.split("/")


def workload_kinds(config: RenderConfig) -> list[tuple[str, str]]:
    """Gives the (apiVersion, kind) of the workloads a pool may own under `config`."""
    kinds = [("apps/v1", "Deployment"), ("apps/v1", "StatefulSet")]
    if config.leader_worker_set:
        kinds.append((LWS_API_VERSION, "LeaderWorkerSet"))
    return kinds


@kopf.on.resume(GROUP, VERSION, "prefillpools")
@kopf.on.create(GROUP, VERSION, "prefillpools")
@kopf.on.update(GROUP, VERSION, "prefillpools")
@kopf.on.resume(GROUP, VERSION, "decodepools")
@kopf.on.create(GROUP, VERSION, "decodepools")
@kopf.on.update(GROUP, VERSION, "decodepools")
async def reconcile_pool(body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status,
                         patch: kopf.Patch, memo: kopf.Memo, reason: str,
                         models_by_name: kopf.Index, **_: Any) -> None:
    """Brings a pool's workloads, Services and PDB to its spec and writes its status."""
    namespace, generation = meta["namespace"], meta.get("generation")
    kube: Kube = memo.kube
    config: RenderConfig = memo.render
    now = now_rfc3339()
    pool = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(meta),
            "spec": dict(spec)}
    try:
        resolved = await resolve_stored_pool(kube, body["kind"], namespace, spec, models_by_name)
        objects = await off_loop(render_pool, pool, resolved, config)
    except ValueError as exc:
        await reject(kube, pool, patch, status, "InvalidSpec", describe_error(exc), now)
        return
    kinds = [*workload_kinds(config), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"),
             ("networking.k8s.io/v1", "NetworkPolicy")]
    try:
        if resolved.model_ref is None:  # no InferenceModel makes its fleet Secret
            await ensure_fleet_secret(kube, meta["name"], namespace, pool)
        # Pruning covers scale-down of multi-node groups and a single/multi-node switch.
        current = await sync_children(kube, pool, objects, kinds, {POOL_LABEL: meta["name"]},
                                      prune_stale=reason != "create")
    except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
        await reject_apply_error(exc, kube, pool, patch, status, now)
        return
    workloads = {kind for _, kind in workload_kinds(config)}
    ready = workload_ready([o for o in current if o.get("kind") in workloads])
    patch.status.update(pool_status(resolved.replicas, ready, pool_selector(pool),
                                    generation, status.get("conditions"), now))
    patch.status["observedGeneration"] = generation
