"""A pool's workloads: one Deployment when a replica fits a node, else a leader/worker group per replica.

Multi-node groups are StatefulSets (one per replica, `<pool>-g<i>`, pods
`<pool>-g<i>-<rank>`) sharing the pool's headless Service, so rank 0 has a
stable DNS name the others rendezvous with. When the LeaderWorkerSet CRD is
installed (`RenderConfig.leader_worker_set`) one LeaderWorkerSet replaces them.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.contracts.rendezvous import (
    MASTER_ADDR,
    MASTER_PORT,
    NNODES,
    NODE_RANK,
    WORLD_SIZE,
)
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.meta import (
    POD_INDEX_LABEL,
    RENDEZVOUS_PORT,
    REPLICA_LABEL,
    RenderConfig,
    child_name,
    object_meta,
    selector_labels,
)
from kvpilot.operator.render.pods import pod_template
from kvpilot.operator.render.services import LWS_WORKER_INDEX_LABEL, rendezvous_service_name

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def group_name(pool: str, replica: int) -> str:
    """Gives the StatefulSet name of one multi-node replica."""
    return child_name(pool, f"g{replica}")


def pool_workloads(name: str, namespace: str, pool: ResolvedPool, labels: dict[str, str],
                   owner: dict[str, Any], config: RenderConfig,
                   annotations: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Gives the Deployment, the StatefulSets, or the LeaderWorkerSet that run a pool's replicas."""
    if pool.placement.nodes_per_replica == 1:
        template = pod_template(pool, labels, config, annotations=annotations)
        return [_deployment(name, namespace, pool, labels, owner, template)]
    if config.leader_worker_set:
        return [_leader_worker_set(name, namespace, pool, labels, owner, config, annotations)]
    return [_group(name, namespace, i, pool, labels, owner, config, annotations)
            for i in range(pool.replicas)]


def _deployment(name: str, namespace: str, pool: ResolvedPool, labels: dict[str, str],
                owner: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": object_meta(name, namespace, labels, owner),
        "spec": {
            "replicas": pool.replicas,
            # The Deployment controller then sets Progressing=False, ProgressDeadlineExceeded,
            # which the pool's status repeats (StatefulSet groups are timed from their pods).
            "progressDeadlineSeconds": pool.progress_deadline_seconds,
            "selector": {"matchLabels": selector_labels(labels)},
            # Never drop below the desired count during a rollout; a new pod must be
            # ready (weights loaded) before an old one drains.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": template,
        },
    }


def _rendezvous_env(world_size: int, nodes: int, master_addr: str,
                    rank_label: str) -> list[dict[str, Any]]:
    """Gives the group env the engine reads (`kvpilot.engine.contracts.rendezvous`)."""
    return [
        {"name": MASTER_ADDR, "value": master_addr},
        {"name": MASTER_PORT, "value": str(RENDEZVOUS_PORT)},
        {"name": WORLD_SIZE, "value": str(world_size)},
        {"name": NNODES, "value": str(nodes)},
        {"name": NODE_RANK, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{rank_label}']"}}},
    ]


def _group(pool_name: str, namespace: str, replica: int, pool: ResolvedPool,
           labels: dict[str, str], owner: dict[str, Any], config: RenderConfig,
           annotations: dict[str, str] | None) -> dict[str, Any]:
    name = group_name(pool_name, replica)
    service = rendezvous_service_name(pool_name)
    nodes = pool.placement.nodes_per_replica
    env = _rendezvous_env(nodes * pool.placement.gpus_per_pod, nodes,
                          f"{name}-0.{service}.{namespace}.svc", POD_INDEX_LABEL)
    group_labels = {**labels, REPLICA_LABEL: str(replica)}
    template = pod_template(pool, group_labels, config, extra_env=env, annotations=annotations)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": object_meta(name, namespace, group_labels, owner),
        "spec": {
            "replicas": nodes,
            "serviceName": service,
            # All ranks start together: the collective init waits for every one of them.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(group_labels)},
            "template": template,
        },
    }


def _leader_worker_set(name: str, namespace: str, pool: ResolvedPool, labels: dict[str, str],
                       owner: dict[str, Any], config: RenderConfig,
                       annotations: dict[str, str] | None) -> dict[str, Any]:
    nodes = pool.placement.nodes_per_replica
    # LWS injects LWS_LEADER_ADDRESS into every container of the group.
    env = _rendezvous_env(nodes * pool.placement.gpus_per_pod, nodes, "$(LWS_LEADER_ADDRESS)",
                          LWS_WORKER_INDEX_LABEL)
    template = pod_template(pool, labels, config, extra_env=env, annotations=annotations)
    return {
        "apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet",
        "metadata": object_meta(name, namespace, labels, owner),
        "spec": {
            "replicas": pool.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": nodes,
                # A lost rank breaks the collective: restart the whole group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            },
        },
    }
