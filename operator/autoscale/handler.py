"""kopf timers that autoscale pools: scrape, decide, share the GPU budget, patch, report.

One timer per pool ticks every second and acts every `intervalSeconds`. It
scrapes the pool's ready pods (and, at zero replicas, the routers' held
requests), runs the pure policy, caps the result by the InferenceModel's GPU
budget, marks the least-loaded pods for deletion before a scale-down, patches
`spec.replicas` (the pool handler rolls it out) and writes KV%, QUEUE and the
last decision into the status with an event. Per-pool policy state lives in
kopf's per-object memo; the loads the budget compares live in the operator's memo.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kvpilot.operator.autoscale.budget import PoolDemand, allocate
from kvpilot.operator.autoscale.pods import DELETION_COST, deletion_costs, metrics_targets
from kvpilot.operator.autoscale.policy import Decision, PolicyState, decide
from kvpilot.operator.autoscale.scrape import PodSample, pool_metrics, router_demand, scrape
from kvpilot.operator.autoscale.signals import PoolMetrics
from kvpilot.operator.autoscale.spec import PolicySpec, from_api
from kvpilot.operator.handlers.kube import Kube
from kvpilot.operator.render.meta import GROUP_VERSION, MODEL_LABEL, POOL_LABEL
from kvpilot.operator.render.router import router_labels

GROUP, VERSION = GROUP_VERSION.split("/")
TICK_S = 1.0
SCRAPE_TIMEOUT_S = 2.0
HISTORY = 16


@dataclass
class PoolRuntime:
    """What the timer keeps for one pool between ticks."""

    state: PolicyState = field(default_factory=PolicyState)
    history: deque[PoolMetrics] = field(default_factory=lambda: deque(maxlen=HISTORY))
    samples: dict[str, PodSample] = field(default_factory=dict)
    next_run: float = 0.0
    last_hold: str = ""


def role_of(body: kopf.Body) -> str:
    """Gives the pool's engine role."""
    if body["kind"] == "PrefillPool":
        return "prefill"
    return (body.get("spec") or {}).get("role", "both")


def _gpus_per_replica(spec: kopf.Spec) -> int:
    topology = spec.get("topology") or {}
    return int(topology.get("tensorParallel", 1)) * int(topology.get("pipelineParallel", 1))


def decision_reason(d: Decision, budget: str | None) -> str:
    """Gives the one-line reason the status and the event carry."""
    parts = [d.reason]
    if d.held_by:
        parts.append("held by " + ", ".join(d.held_by))
    if budget:
        parts.append(budget)
    return "; ".join(parts)


def status_fields(metrics: PoolMetrics, role: str) -> dict[str, Any]:
    """Gives the KV% and QUEUE status fields from the latest sample."""
    out: dict[str, Any] = {}
    if metrics.kv_cache_utilization is not None:
        kv = min(max(metrics.kv_cache_utilization, 0.0), 1.0)
        out["kvCacheUtilization"] = round(kv, 3)
        out["kvCachePercent"] = round(kv * 100)
    if metrics.requests_waiting is not None:
        out["queueDepth"] = round(metrics.requests_waiting)
    return out


async def _budget(kube: Kube, meta: kopf.Meta, spec: kopf.Spec, role: str, desired: int,
                  load: float, shared: dict[tuple[str, str], float]) -> tuple[int, str | None]:
    """Gives `desired` within the InferenceModel's GPU budget, and the budget's message."""
    model = spec.get("modelRef")
    if not model:
        return desired, None
    namespace, name = meta["namespace"], meta["name"]
    im = await kube.get(GROUP_VERSION, "InferenceModel", namespace, model)
    budget = ((im or {}).get("spec") or {}).get("gpuBudget")
    if budget is None:
        return desired, None
    pools: list[PoolDemand] = []
    for kind in ("PrefillPool", "DecodePool"):
        for pool in await kube.list(GROUP_VERSION, kind, namespace):
            pspec = pool.get("spec") or {}
            if pspec.get("modelRef") != model:
                continue
            other = pool["metadata"]["name"]
            current = int(pspec.get("replicas", 1))
            autoscaling = pspec.get("autoscaling")
            # A pool without autoscaling cannot give replicas back: its floor is its size.
            floor = int(autoscaling.get("minReplicas", 1)) if autoscaling else current
            pools.append(PoolDemand(
                other, current=current, desired=desired if other == name else current,
                min_replicas=floor,
                gpus_per_replica=_gpus_per_replica(pspec),
                load=load if other == name else shared.get((namespace, other), current)))
    grant = allocate(int(budget), pools)
    return grant.replicas.get(name, desired), grant.message if grant.binds else None


async def _mark_for_removal(kube: Kube, namespace: str, samples: dict[str, PodSample],
                            pods: list[dict[str, Any]]) -> None:
    """Sets pod-deletion-cost so the ReplicaSet removes the least-loaded pods first."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    for pod, cost in deletion_costs(samples).items():
        annotations = (by_name.get(pod, {}).get("metadata") or {}).get("annotations") or {}
        if annotations.get(DELETION_COST) != str(cost):
            await kube.patch("v1", "Pod", namespace, pod,
                             {"metadata": {"annotations": {DELETION_COST: str(cost)}}})


@kopf.on.startup()
async def shared_loads(memo: kopf.Memo, **_: Any) -> None:
    """Gives every pool's timer one shared table of pool loads (for the GPU budget)."""
    memo.autoscale_loads = {}


@kopf.timer(GROUP, VERSION, "prefillpools", interval=TICK_S,
            when=lambda spec, **_: bool(spec.get("autoscaling")))
@kopf.timer(GROUP, VERSION, "decodepools", interval=TICK_S,
            when=lambda spec, **_: bool(spec.get("autoscaling")))
async def autoscale_pool(body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec,
                         status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo,
                         **_: Any) -> None:
    """Scrapes the pool, decides its replicas and patches spec.replicas and status."""
    runtime: PoolRuntime = memo.setdefault("autoscale_runtime", PoolRuntime())
    now = time.time()
    if now < runtime.next_run:
        return
    role = role_of(body)
    try:
        pspec: PolicySpec = from_api(spec["autoscaling"], role, _gpus_per_replica(spec))
    except (ValueError, TypeError) as exc:
        raise kopf.PermanentError(f"spec.autoscaling is invalid: {exc}") from exc
    runtime.next_run = now + pspec.interval_seconds
    kube: Kube = memo.kube
    namespace, name = meta["namespace"], meta["name"]
    current = int(spec.get("replicas", 1))

    pods = await kube.list("v1", "Pod", namespace, {POOL_LABEL: name})
    samples = await scrape(metrics_targets(pods), SCRAPE_TIMEOUT_S)
    demand = 0
    if current == 0:
        model = (meta.get("labels") or {}).get(MODEL_LABEL) or spec.get("modelRef") or name
        routers = await kube.list("v1", "Pod", namespace, router_labels(model))
        demand = await router_demand(list(metrics_targets(routers).values()), role,
                                     SCRAPE_TIMEOUT_S)
    metrics = pool_metrics(samples, runtime.samples, now, demand)
    runtime.samples = samples
    runtime.history.append(metrics)
    d = decide(pspec, runtime.state, runtime.history, current, now)
    runtime.state = d.state

    loads = getattr(memo, "autoscale_loads", {})
    load = d.vote.replicas if d.vote else current
    loads[(namespace, name)] = float(load)
    desired, budget = await _budget(kube, meta, spec, role, d.desired, float(load), loads)

    patch.status.update({k: v for k, v in status_fields(metrics, role).items()
                         if status.get(k) != v})
    hold = decision_reason(d, budget)
    # A hold is reported once per cause, not on every tick its numbers move.
    hold_key = f"{d.recommendation}|{'|'.join(d.held_by)}|{budget is not None}"
    frozen = any(h.startswith("missing data") for h in d.held_by)
    if desired == current and ((d.recommendation == current and not frozen)
                               or hold_key == runtime.last_hold):
        return
    runtime.last_hold = hold_key
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    patch.status["lastScaleDecision"] = {"time": stamp, "pool": name, "fromReplicas": current,
                                         "toReplicas": desired, "reason": hold[:1000]}
    if desired == current:
        kopf.event(body, type="Normal", reason="ScaleHeld",
                   message=f"{current} replicas: {hold}"[:1000])
        return
    if desired < current:
        await _mark_for_removal(kube, namespace, samples, pods)
    patch.spec["replicas"] = desired
    # kopf.event, not kopf.info: the operator posts only warnings of its own log
    # lines (settings.posting.level), but scale decisions must reach `kubectl describe`.
    kopf.event(body, type="Normal", reason="ScaledUp" if desired > current else "ScaledDown",
               message=f"{current} -> {desired} replicas: {hold}"[:1000])
