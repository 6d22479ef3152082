"""Names, labels, owner references and operator-wide render settings shared by every renderer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.engine.contracts.router_args import ROLE_LABEL

GROUP_VERSION = "kvpilot.dev/v1alpha1"
MODEL_LABEL = "kvpilot.dev/model"
POOL_LABEL = "kvpilot.dev/pool"
COMPONENT_LABEL = "app.kubernetes.io/component"
REPLICA_LABEL = "kvpilot.dev/replica"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller (1.28+)
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvpilot", "app.kubernetes.io/part-of": "kvpilot"}
ENGINE_PORT = 8000
ROUTER_PORT = 8080
RENDEZVOUS_PORT = 29500

__all__ = ["ROLE_LABEL"]


@dataclass(frozen=True)
class RenderConfig:
    """Operator-wide settings the renderers need (from `kvpilot operator` flags)."""

    engine_image: str = "ghcr.io/kvpilot/engine:0.1.0"
    """Engine image when the spec's overrides name none."""
    router_image: str = "ghcr.io/kvpilot/operator:0.1.0"
    """Image of the router pods (torch-free; it carries `kvpilot route`)."""
    leader_worker_set: bool = False
    """Render multi-node replicas as LeaderWorkerSets (the LWS CRD is installed)."""
    drain_timeout_seconds: int = 30
    """Seconds an engine gets to finish in-flight requests after SIGTERM."""
    inference_pool: bool = False
    """Render InferencePools for models that ask (the Gateway API inference CRD is installed)."""
    max_pool_gpus: int = 4096
    """Most GPUs one pool may ask for at its replicas: what one object can make the operator
    render and apply stays bounded even without a gpuBudget."""
    operator_namespace: str | None = None
    """Namespace of the operator's pods (None: the models' own), for NetworkPolicies."""
    operator_pod_labels: tuple[tuple[str, str], ...] = (
        ("app.kubernetes.io/name", "kvpilot"), ("app.kubernetes.io/component", "operator"))
    """Labels of the operator's pods: NetworkPolicies let them scrape engines and routers."""
    metrics_namespaces: tuple[str, ...] = ()
    """Namespaces (a Prometheus) whose pods may also scrape engines' and routers' /metrics."""
    compile_cache_dir: str = ""
    """A node directory (writable by the engine's uid 1000) mounted as every engine pod's
    TRITON_CACHE_DIR, so a replica started on a node that served before finds its compiled
    kernels there ("": the pod's own emptyDir, lost with the pod)."""


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    """Gives the controller owner reference that ties a child to `owner` for garbage collection."""
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def object_meta(name: str, namespace: str, labels: dict[str, str],
                owner: dict[str, Any] | None = None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """Gives `metadata` of a child object with the kvpilot labels and the owner reference."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {**MANAGED_BY, **labels}}
    if annotations:
        meta["annotations"] = dict(annotations)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def pool_labels(model: str, pool: str, role: str) -> dict[str, str]:
    """Gives the selector labels of one pool's pods (stable: selectors are immutable)."""
    return {MODEL_LABEL: model, POOL_LABEL: pool, ROLE_LABEL: role, COMPONENT_LABEL: "engine"}


def selector_labels(labels: dict[str, str]) -> dict[str, str]:
    """Gives the labels workload selectors match on: the ones that never change for a pool.

    Deployment and StatefulSet selectors are immutable, so the role (which flips when a
    model switches serving mode) and the component stay out of them.
    """
    return {k: v for k, v in labels.items() if k in (MODEL_LABEL, POOL_LABEL, REPLICA_LABEL)}
