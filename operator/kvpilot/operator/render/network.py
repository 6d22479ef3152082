"""NetworkPolicies: who may reach a model's engines and its router.

Per pool (selecting its pods; ingress only, egress stays open for weight downloads):
- the engines' HTTP port from the model's router, the operator (it scrapes /metrics), the
  `--metrics-namespace`s and the pool's own `allowFrom`;
- the KV-transfer port from the model's engines (prefill -> decode pulls) and its router
  (which sends the decode agent its PULL);
- every port between the pods of one multi-node replica group (NCCL picks its ports).
Per InferenceModel, the router's port from `router.allowFrom` (unset: anywhere, like a
plain Service: the router is the model's endpoint and checks the API key) and the operator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.operator.api.access import NetworkPeer
from kvpilot.operator.api.names import router_name
from kvpilot.operator.render.meta import (
    COMPONENT_LABEL,
    ENGINE_PORT,
    MODEL_LABEL,
    POOL_LABEL,
    ROUTER_PORT,
    RenderConfig,
    object_meta,
    selector_labels,
)
from kvpilot.operator.render.pods import KV_TRANSFER_PORT

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace (1.22+)


def _namespace(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: name}}}


def scraper_peers(config: RenderConfig) -> list[dict[str, Any]]:
    """Gives the peers that scrape /metrics: the operator's pods and the metrics namespaces."""
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(config.operator_pod_labels)}}
    if config.operator_namespace:
        operator.update(_namespace(config.operator_namespace))
    return [operator, *(_namespace(ns) for ns in config.metrics_namespaces)]


def _pods(labels: dict[str, str]) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": labels}}


def _port(number: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": number}]


def _policy(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any],
            selector: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_meta(name, namespace, labels, owner),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}


def pool_network_policy(name: str, namespace: str, labels: dict[str, str],
                        owner: dict[str, Any], allow_from: Sequence[NetworkPeer],
                        multi_node: bool, config: RenderConfig) -> dict[str, Any]:
    """Gives the NetworkPolicy of one pool's engine pods."""
    model = labels[MODEL_LABEL]
    router = _pods({MODEL_LABEL: model, COMPONENT_LABEL: "router"})
    engines = _pods({MODEL_LABEL: model, COMPONENT_LABEL: "engine"})
    ingress = [
        {"from": [router, *scraper_peers(config), *(p.to_json() for p in allow_from)],
         "ports": _port(ENGINE_PORT)},
        {"from": [engines, router], "ports": _port(KV_TRANSFER_PORT)},
    ]
    if multi_node:
        ingress.append({"from": [_pods({MODEL_LABEL: model, POOL_LABEL: name})]})
    return _policy(name, namespace, labels, owner, selector_labels(labels), ingress)


def router_network_policy(model: str, namespace: str, labels: dict[str, str],
                          owner: dict[str, Any], allow_from: Sequence[NetworkPeer] | None,
                          config: RenderConfig) -> dict[str, Any]:
    """Gives the NetworkPolicy of a model's router pods."""
    rule: dict[str, Any] = {"ports": _port(ROUTER_PORT)}
    if allow_from is not None:
        rule["from"] = [*(p.to_json() for p in allow_from), *scraper_peers(config)]
    return _policy(router_name(model), namespace, labels, owner, labels, [rule])
