"""The InferenceModel's side of autoscaling: its GPU budget over its pools, and its KV%/QUEUE.

Each pool's timer records what it saw in a table shared by all timers of the
operator (`PoolReport` by namespace and pool); from it and the API's pool list
it computes the model's budget allocation and takes its own entry, and it rolls
KV usage (decode pools) and queue depth (all pools) up into the model's status.
Pure: the timer (autoscale/handler.py) reads the objects and writes the patches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.autoscale.budget import PoolDemand, allocate
from kvpilot.operator.kube.diff import differs


@dataclass(frozen=True)
class PoolReport:
    """What a pool's timer last saw of its pool."""

    model: str | None
    role: str
    load: float
    """Replicas the pool needs at its targets (its winning vote)."""
    kv: float | None = None
    queue: float | None = None


def gpus_per_replica(spec: Mapping[str, Any]) -> int:
    """Gives the GPUs one replica of a pool spec holds (tensor × pipeline parallel)."""
    topology = spec.get("topology") or {}
    return int(topology.get("tensorParallel", 1)) * int(topology.get("pipelineParallel", 1))


def budget_demands(pools: Sequence[Mapping[str, Any]], model: str, name: str, desired: int,
                   shared: Mapping[tuple[str, str], PoolReport]) -> list[PoolDemand]:
    """Gives the budget's view of the model's pools: this one wants `desired`, the others
    keep their size; a pool kvpilot does not scale (static, or mode external) cannot give
    replicas back."""
    out = []
    for pool in pools:
        spec = pool.get("spec") or {}
        if spec.get("modelRef") != model:
            continue
        meta = pool["metadata"]
        current = int(spec.get("replicas", 1))
        autoscaling = spec.get("autoscaling")
        report = shared.get((meta.get("namespace", ""), meta["name"]))
        out.append(PoolDemand(
            meta["name"], current=current, desired=desired if meta["name"] == name else current,
            min_replicas=int(autoscaling.get("minReplicas", 1))
            if autoscaling and autoscaling.get("mode", "kvpilot") == "kvpilot" else current,
            gpus_per_replica=gpus_per_replica(spec),
            load=report.load if report else float(current)))
    return out


def gpu_budget(im: Mapping[str, Any] | None) -> int | None:
    """Gives the InferenceModel's spec.gpuBudget (None without a model or a budget)."""
    budget = ((im or {}).get("spec") or {}).get("gpuBudget")
    return None if budget is None else int(budget)


def within_budget(budget: int, pools: Sequence[Mapping[str, Any]], model: str, name: str,
                  desired: int, shared: Mapping[tuple[str, str], PoolReport]
                  ) -> tuple[int, str | None]:
    """Gives `desired` cut to pool `name`'s share of the model's GPU `budget` over the `pools`
    the API lists, and the message when the budget binds."""
    grant = allocate(budget, budget_demands(pools, model, name, desired, shared))
    return grant.replicas.get(name, desired), grant.message if grant.binds else None


def load_fields(kv: float | None, queue: float | None) -> dict[str, Any]:
    """Gives the KV% and QUEUE status fields (kvCacheUtilization, kvCachePercent, queueDepth)
    of a KV-cache fraction and a queue depth; a None leaves its fields out."""
    out: dict[str, Any] = {}
    if kv is not None:
        kv = min(max(kv, 0.0), 1.0)
        out["kvCacheUtilization"] = round(kv, 3)
        out["kvCachePercent"] = round(kv * 100)
    if queue is not None:
        out["queueDepth"] = round(queue)
    return out


def model_fields(model: str, namespace: str,
                 shared: Mapping[tuple[str, str], PoolReport]) -> dict[str, Any]:
    """Gives the model's KV% (mean of its decode pools) and QUEUE (sum of all its pools)."""
    reports = [r for (ns, _), r in shared.items() if ns == namespace and r.model == model]
    kvs = [r.kv for r in reports if r.role != "prefill" and r.kv is not None]
    queues = [r.queue for r in reports if r.queue is not None]
    return load_fields(sum(kvs) / len(kvs) if kvs else None, sum(queues) if queues else None)


def model_status_patch(im: Mapping[str, Any] | None, namespace: str,
                       shared: Mapping[tuple[str, str], PoolReport],
                       decision: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Gives the model's status patch (KV%, QUEUE, the latest decision), or None when there is
    no model or its status already says so."""
    if im is None:
        return None
    status = model_fields(im["metadata"]["name"], namespace, shared)
    if decision is not None:
        status["lastScaleDecision"] = dict(decision)
    return status if status and differs(im.get("status") or {}, status) else None
