"""Services of a pool: the ClusterIP Service the router discovers, and the headless rendezvous Service."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.names import rendezvous_service_name
from kvpilot.operator.render.meta import (
    ENGINE_PORT,
    POD_INDEX_LABEL,
    RENDEZVOUS_PORT,
    object_meta,
    selector_labels,
)
from kvpilot.operator.render.pods import KV_TRANSFER_PORT

LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def serving_selector(labels: dict[str, str], multi_node: bool,
                     leader_worker_set: bool) -> dict[str, str]:
    """Gives the labels of a pool's pods that serve HTTP: all of them, or with multi-node
    replicas only each group's leader (the pool Service and the InferencePool select these)."""
    selector = selector_labels(labels)
    if multi_node:
        # Only rank 0 of a leader/worker group serves HTTP; workers join over the rendezvous.
        selector[LWS_WORKER_INDEX_LABEL if leader_worker_set else POD_INDEX_LABEL] = "0"
    return selector


def pool_service(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any],
                 multi_node: bool, leader_worker_set: bool) -> dict[str, Any]:
    """Gives the pool's Service; with multi-node replicas it selects only each group's leader."""
    selector = serving_selector(labels, multi_node, leader_worker_set)
    # The EndpointSlice controller copies these labels, which is how the router finds pools.
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": object_meta(name, namespace, labels, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "kv-transfer", "port": KV_TRANSFER_PORT, "targetPort": "kv-transfer",
                 "protocol": "TCP"},
            ],
        },
    }


def rendezvous_service(pool: str, namespace: str, labels: dict[str, str],
                       owner: dict[str, Any]) -> dict[str, Any]:
    """Gives the headless Service that gives each group member a stable DNS name."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": object_meta(rendezvous_service_name(pool), namespace,
                                {**labels, "kvpilot.dev/headless": "true"}, owner),
        "spec": {
            "clusterIP": "None",
            # Workers must resolve the leader before any of them is ready.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(labels),
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT,
                       "targetPort": "rendezvous", "protocol": "TCP"}],
        },
    }
