"""The router in front of an InferenceModel's pools: Deployment, Service, its discovery RBAC and
NetworkPolicy.

The router is the one kvpilot pod with an API token: it lists its model's EndpointSlices
(a Role allowing exactly that). The pod mounts no token automatically; the router
container alone gets it, projected explicitly (as kubelet would, kube-root-ca.crt and the
namespace beside it), so no other container of the pod ever holds it.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.contracts.fleet_secret import FLEET_SECRET_PATH
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.contracts.router_objectives import Objective, objectives_json
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.names import router_name
from kvpilot.operator.render.fleet import FLEET_MOUNT, api_key_env, fleet_volume
from kvpilot.operator.render.meta import (
    COMPONENT_LABEL,
    MODEL_LABEL,
    ROUTER_PORT,
    RenderConfig,
    object_meta,
)
from kvpilot.operator.render.network import router_network_policy

TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where discovery reads it
# What kubelet projects when it mounts a token itself (3607 s, refreshed by kubelet).
TOKEN_VOLUME = {"name": "api-token", "projected": {"defaultMode": 0o444, "sources": [
    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace",
                                "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
]}}


def router_labels(model: str) -> dict[str, str]:
    """Gives the selector labels of the router's pods."""
    return {MODEL_LABEL: model, COMPONENT_LABEL: "router"}


def apply_flow(args: RouterArgs, spec: InferenceModelSpec) -> RouterArgs:
    """Gives `args` with `spec.router.flowControl` and `spec.router.objectives` set (values
    the InferenceModel's validation already bounded)."""
    flow = spec.router.flow_control
    if flow is not None:
        args.flow_control = True
        args.saturation_queue_depth = flow.saturation_queue_depth
        args.saturation_kv_usage = flow.saturation_kv_cache_usage
        args.reserved_slots_fraction = flow.reserved_slots_fraction
        args.max_queued_per_flow = flow.max_queued_per_flow
        args.max_queued_requests = flow.max_queued_requests
        args.queue_timeout = flow.queue_timeout_seconds
        args.slo_unmeetable = flow.slo_unmeetable
    if spec.router.objectives:
        args.objectives = objectives_json(tuple(
            Objective(o.name, o.priority, tuple(o.models or ()),
                      None if o.ttft_ms is None else float(o.ttft_ms),
                      None if o.tpot_ms is None else float(o.tpot_ms))
            for o in spec.router.objectives))
    return args


def router_args(model: str, namespace: str, spec: InferenceModelSpec) -> list[str]:
    """Gives the arguments after `kvpilot route`: discover this model's pool Services' endpoints."""
    source = spec.model.source
    args = RouterArgs(
        host="0.0.0.0", port=ROUTER_PORT, discovery="kubernetes", namespace=namespace,
        # Only pool Services carry a role label; the router's own Service has none.
        selector=f"{MODEL_LABEL}={model},kvpilot.dev/role",
        policy=spec.router.policy, block_size=spec.engine.block_size,
        # Built-in models ship their tokenizer in the image, so prefix hashes match the engines'.
        tokenizer=source.removeprefix("dummy:") if source.startswith("dummy:") else None,
        fleet_secret_file=FLEET_SECRET_PATH,
    )
    return apply_flow(args, spec).to_cli()


def endpoint_url(model: str, namespace: str) -> str:
    """Gives the in-cluster URL of the model's OpenAI API."""
    return f"http://{router_name(model)}.{namespace}.svc:{ROUTER_PORT}/v1"


def render_router(model: str, namespace: str, spec: InferenceModelSpec, owner: dict[str, Any],
                  config: RenderConfig) -> list[dict[str, Any]]:
    """Gives the router's ServiceAccount, Role, RoleBinding, Deployment, Service and
    NetworkPolicy."""
    name = router_name(model)
    labels = router_labels(model)
    meta = object_meta(name, namespace, labels, owner)
    container = {
        "name": "router",
        "image": config.router_image,
        "command": ["kvpilot", "route"],
        "args": router_args(model, namespace, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": api_key_env(spec.auth),
        "volumeMounts": [FLEET_MOUNT, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": TOKEN_VOLUME["name"], "mountPath": TOKEN_DIR,
                          "readOnly": True}],
        # /health, not /ready: the router must take requests while a pool scales from
        # zero (it holds them until an engine is ready), so it is ready without engines.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"},
                      "limits": {"memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT)}},
                "spec": {"serviceAccountName": name, "automountServiceAccountToken": False,
                         "containers": [container],
                         "volumes": [fleet_volume(model), TOKEN_VOLUME,
                                     {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}],
                         "enableServiceLinks": False,
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                             "runAsGroup": 1000, "fsGroup": 1000,
                                             "seccompProfile": {"type": "RuntimeDefault"}}},
            },
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"type": "ClusterIP", "selector": labels, "ports": [
            {"name": "http", "port": ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}]},
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
        "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                   "verbs": ["get", "list", "watch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    policy = router_network_policy(model, namespace, labels, owner, spec.router.allow_from,
                                   config)
    return [account, role, binding, deployment, service, policy]
