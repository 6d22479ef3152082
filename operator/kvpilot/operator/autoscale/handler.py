"""kopf timers that autoscale pools: scrape, decide, share the GPU budget, patch, report.

One timer per pool in `autoscaling.mode: kvpilot` ticks every second and acts every
`intervalSeconds`. It scrapes the pool's ready pods (and, at zero replicas, the routers'
held requests), runs the pure policy, caps the result by the InferenceModel's GPU budget,
marks the least-loaded pods for deletion before a scale-down, applies `spec.replicas` as
the `kvpilot-autoscaler` field manager (the pool handler rolls it out) and writes KV%,
QUEUE and the last decision into the status with an event. Per-pool policy state lives in
kopf's per-object memo; the loads the budget compares live in the operator's memo.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import kopf

from kvpilot.operator.autoscale.model import (
    PoolReport,
    gpu_budget,
    gpus_per_replica,
    load_fields,
    model_status_patch,
    within_budget,
)
from kvpilot.operator.autoscale.pods import DELETION_COST, deletion_costs, metrics_targets
from kvpilot.operator.autoscale.policy import Decision, PolicyState, decide
from kvpilot.operator.autoscale.scrape import (
    PodSample,
    pool_metrics,
    prometheus_metrics,
    router_demand,
    scrape,
)
from kvpilot.operator.autoscale.signals import PoolMetrics
from kvpilot.operator.autoscale.spec import PolicySpec, from_api
from kvpilot.operator.handlers.events import record
from kvpilot.operator.handlers.resolve import resolve_stored_pool
from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.ownership import AUTOSCALER_MANAGER, replicas_only
from kvpilot.operator.render.meta import GROUP_VERSION, MODEL_LABEL, POOL_LABEL
from kvpilot.operator.render.router import router_labels
from kvpilot.operator.status import describe_error, now_rfc3339

GROUP, VERSION = GROUP_VERSION.split("/")
POOL_KINDS = ("PrefillPool", "DecodePool")
PROMETHEUS_ENV = "KVPILOT_PROMETHEUS_URL"
"""When set (e.g. http://prometheus.monitoring:9090), pools are read from its query API
instead of scraping their pods (no TTFT/ITL then, and no pod-deletion-cost ordering)."""
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


def decision_reason(d: Decision, budget: str | None) -> str:
    """Gives the one-line reason the status and the event carry."""
    parts = [d.reason]
    if d.held_by:
        parts.append("held by " + ", ".join(d.held_by))
    if budget:
        parts.append(budget)
    return "; ".join(parts)


async def _mark_for_removal(kube: Kube, namespace: str, samples: dict[str, PodSample],
                            pods: list[dict[str, Any]]) -> None:
    """Sets pod-deletion-cost so the ReplicaSet removes the least-loaded pods first."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    for pod, cost in deletion_costs(samples).items():
        annotations = (by_name.get(pod, {}).get("metadata") or {}).get("annotations") or {}
        if annotations.get(DELETION_COST) == str(cost):
            continue
        try:
            await kube.patch("v1", "Pod", namespace, pod,
                             {"metadata": {"annotations": {DELETION_COST: str(cost)}}})
        except KubeError as exc:
            if exc.status != 404:  # a pod gone since the listing needs no cost
                raise


@kopf.on.startup()
async def shared_reports(memo: kopf.Memo, **_: Any) -> None:
    """Gives every pool's timer one shared table of what each pool saw (budget, rollup)."""
    memo.autoscale_pools = {}


def autoscaled(spec: kopf.Spec, **_: Any) -> bool:
    """Gives whether a pool asks kvpilot to scale it (its timer runs only then); mode external
    leaves it to an HPA or KEDA."""
    autoscaling = spec.get("autoscaling")
    return bool(autoscaling) and autoscaling.get("mode", "kvpilot") == "kvpilot"


@kopf.timer(GROUP, VERSION, "prefillpools", interval=TICK_S, when=autoscaled)
@kopf.timer(GROUP, VERSION, "decodepools", interval=TICK_S, when=autoscaled)
async def autoscale_pool(body: kopf.Body, meta: kopf.Meta, spec: kopf.Spec,
                         status: kopf.Status, patch: kopf.Patch, memo: kopf.Memo,
                         models_by_name: kopf.Index, **_: Any) -> None:
    """Scrapes the pool, decides its replicas and applies spec.replicas; patches status."""
    runtime: PoolRuntime = memo.setdefault("autoscale_runtime", PoolRuntime())
    now = time.time()
    if now < runtime.next_run:
        return
    kube: Kube = memo.kube
    namespace, name = meta["namespace"], meta["name"]
    try:
        pool = await resolve_stored_pool(kube, body["kind"], namespace, spec, models_by_name)
        # Counted as the budget counts the stored sibling pools.
        pspec: PolicySpec = from_api(pool.autoscaling, pool.role,
                                     gpus_per_replica(pool.to_json()))
    except ValueError as exc:
        raise kopf.PermanentError(f"cannot autoscale: {describe_error(exc)}") from exc
    runtime.next_run = now + pspec.interval_seconds
    current = pool.replicas

    demand = 0
    if current == 0:
        owner = (meta.get("labels") or {}).get(MODEL_LABEL) or pool.model_ref or name
        routers = await kube.list("v1", "Pod", namespace, router_labels(owner))
        demand = await router_demand(list(metrics_targets(routers).values()), pool.role,
                                     SCRAPE_TIMEOUT_S)
    prometheus = os.environ.get(PROMETHEUS_ENV)
    if prometheus:
        # Deployment pods are named <pool>-<hash>-<id>: the pool's name is their prefix.
        found = await prometheus_metrics(prometheus, namespace, f'pod=~"{name}-.*"', now)
        samples: dict[str, PodSample] = {}
        pods: list[dict[str, Any]] = []  # without samples there are no deletion costs to set
        metrics = replace(found, demand=demand) if found else PoolMetrics(now, 0, demand=demand)
    else:
        pods = await kube.list("v1", "Pod", namespace, {POOL_LABEL: name})
        samples = await scrape(metrics_targets(pods), SCRAPE_TIMEOUT_S)
        metrics = pool_metrics(samples, runtime.samples, now, demand)
    runtime.samples = samples
    runtime.history.append(metrics)
    d = decide(pspec, runtime.state, runtime.history, current, now)
    runtime.state = d.state

    fields = load_fields(metrics.kv_cache_utilization, metrics.requests_waiting)
    shared: dict[tuple[str, str], PoolReport] = getattr(memo, "autoscale_pools", {})
    model = pool.model_ref
    shared[(namespace, name)] = PoolReport(
        model, pool.role, float(d.vote.replicas if d.vote else current),
        fields.get("kvCacheUtilization"), metrics.requests_waiting)
    im = await kube.get(GROUP_VERSION, "InferenceModel", namespace, model) if model else None
    desired, binding = d.desired, None
    if model is not None and (budget := gpu_budget(im)) is not None:
        pools = [p for kind in POOL_KINDS for p in await kube.list(GROUP_VERSION, kind, namespace)]
        desired, binding = within_budget(budget, pools, model, name, d.desired, shared)
    patch.status.update({k: v for k, v in fields.items() if status.get(k) != v})
    decision = await _decide_and_report(body, d, current, desired, binding, now, runtime,
                                        patch, kube, samples, pods)
    if im is not None and decision is not None:
        # The decision goes on the model too: `kubectl describe im` is where people look.
        moved = decision["toReplicas"] - decision["fromReplicas"]
        await record(kube, im, "ScaledUp" if moved > 0 else "ScaledDown" if moved else
                     "ScaleHeld", f"{name}: {decision['fromReplicas']} -> "
                     f"{decision['toReplicas']} replicas: {decision['reason']}")
    model_patch = model_status_patch(im, namespace, shared, decision)
    if im is not None and model_patch is not None:
        await kube.patch(GROUP_VERSION, "InferenceModel", namespace, im["metadata"]["name"],
                         {"status": model_patch}, subresource="status")


async def _decide_and_report(body: kopf.Body, d: Decision, current: int, desired: int,
                             budget: str | None, now: float, runtime: PoolRuntime,
                             patch: kopf.Patch, kube: Kube, samples: dict[str, PodSample],
                             pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Applies spec.replicas, writes lastScaleDecision and posts the event; gives the
    decision written (None when there was nothing new to say)."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    hold = decision_reason(d, budget)
    # A hold is reported once per cause, not on every tick its numbers move.
    hold_key = f"{d.recommendation}|{'|'.join(d.held_by)}|{budget is not None}"
    frozen = any(h.startswith("missing data") for h in d.held_by)
    if desired == current and ((d.recommendation == current and not frozen)
                               or hold_key == runtime.last_hold):
        return None
    runtime.last_hold = hold_key
    decision = {"time": now_rfc3339(now), "pool": name, "fromReplicas": current,
                "toReplicas": desired, "reason": hold[:1000]}
    patch.status["lastScaleDecision"] = decision
    if desired == current:
        kopf.event(body, type="Normal", reason="ScaleHeld",
                   message=f"{current} replicas: {hold}"[:1000])
        return decision
    if desired < current:
        await _mark_for_removal(kube, namespace, samples, pods)
    # Applied as the autoscaler's field manager, forced: in mode kvpilot replicas are its own.
    await kube.apply(replicas_only(body, desired), force=True, manager=AUTOSCALER_MANAGER)
    # kopf.event, not kopf.info: the operator posts only warnings of its own log
    # lines (settings.posting.level), but scale decisions must reach `kubectl describe`.
    kopf.event(body, type="Normal", reason="ScaledUp" if desired > current else "ScaledDown",
               message=f"{current} -> {desired} replicas: {hold}"[:1000])
    return decision
