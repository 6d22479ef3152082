"""Which of a pool's pods to scrape, and which to remove first: pure functions of pod objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.engine.contracts import metric_names as names
from kvpilot.operator.autoscale.scrape import PodSample
from kvpilot.operator.render.meta import ENGINE_PORT, POD_INDEX_LABEL

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _http_port(pod: Mapping[str, Any]) -> int:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http":
                return int(port["containerPort"])
    return ENGINE_PORT


def metrics_targets(pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Gives {pod name: metrics URL} of the ready engine pods that serve HTTP.

    Pods being deleted are draining and leave the count; of a multi-node replica
    only the leader (pod index 0) runs the server.
    """
    out: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        ip = (pod.get("status") or {}).get("podIP")
        index = (meta.get("labels") or {}).get(POD_INDEX_LABEL, "0")
        if ip and _ready(pod) and not meta.get("deletionTimestamp") and index == "0":
            out[meta["name"]] = f"http://{ip}:{_http_port(pod)}/metrics"
    return out


def deletion_costs(samples: Mapping[str, PodSample]) -> dict[str, int]:
    """Gives each scraped pod's deletion cost: its requests in flight, so idle pods go first.

    The ReplicaSet controller removes pods with the lowest
    `controller.kubernetes.io/pod-deletion-cost` first; pods that did not answer
    get the lowest cost of all (they serve nothing we can see).
    """
    costs: dict[str, int] = {}
    for pod, sample in samples.items():
        if sample.error is not None:
            costs[pod] = -1
            continue
        load = sample.gauges.get(names.NUM_REQUESTS_RUNNING, 0.0) + \
            sample.gauges.get(names.NUM_REQUESTS_WAITING, 0.0)
        costs[pod] = round(load)
    return costs


def removal_order(samples: Mapping[str, PodSample]) -> list[str]:
    """Gives the pods in the order a scale-down should remove them: lowest cost first."""
    costs = deletion_costs(samples)
    return sorted(costs, key=lambda pod: (costs[pod], pod))
