"""PrefillPool and DecodePool handlers: render and apply workloads, Services and PDB; write status."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import kopf

from kvpilot.operator.diagnose import diagnose
from kvpilot.operator.handlers.children import field_conflicts, sync_children
from kvpilot.operator.handlers.events import record_transition
from kvpilot.operator.handlers.observed import Observed
from kvpilot.operator.handlers.rejection import reject, reject_apply_error
from kvpilot.operator.handlers.resolve import resolve_stored_pool
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
                         models_by_name: kopf.Index, **kwargs: Any) -> None:
    """Brings a pool's workloads, Services and PDB to its spec and writes its status."""
    namespace, generation = meta["namespace"], meta.get("generation")
    kube: Kube = memo.kube
    config: RenderConfig = memo.render
    now = now_rfc3339()
    pool = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(meta),
            "spec": dict(spec)}
    try:
        resolved = await resolve_stored_pool(kube, body["kind"], namespace, spec, models_by_name)
        objects = render_pool(pool, resolved, config)
    except ValueError as exc:
        await reject(kube, pool, patch, status, "InvalidSpec", describe_error(exc), now)
        return
    kinds = [*workload_kinds(config), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget")]
    try:
        # Pruning covers scale-down of multi-node groups and a single/multi-node switch.
        applied = await sync_children(kube, pool, objects, kinds, {POOL_LABEL: meta["name"]},
                                      prune_stale=reason != "create")
    except (KubeError, aiohttp.ClientError, TimeoutError) as exc:
        await reject_apply_error(exc, kube, pool, patch, status, now)
        return
    observed = Observed.of(kwargs)
    kinds_run = {kind for _, kind in workload_kinds(config)}
    applied_workloads = [o for o in applied.stored if o.get("kind") in kinds_run]
    # The index follows the workloads' watch events, so it may hold a readiness newer than
    # the apply answers; the roll-up skips this pool until its first status is written.
    indexed = observed.workloads(meta["uid"])
    workloads = indexed if len(indexed) >= len(applied_workloads) else applied_workloads
    failure = diagnose(observed.pool_pods(namespace, meta["name"]), workloads,
                       resolved.progress_deadline_seconds, time.time())
    new = pool_status(resolved.replicas, workload_ready(workloads), pool_selector(pool),
                      generation, status.get("conditions"), now, failure)
    await record_transition(kube, pool, status.get("conditions"), new["conditions"])
    patch.status.update(new)
    patch.status["observedGeneration"] = generation
    conflicts = field_conflicts(applied.conflicts)
    if conflicts or status.get("fieldConflicts"):
        patch.status["fieldConflicts"] = conflicts or None
