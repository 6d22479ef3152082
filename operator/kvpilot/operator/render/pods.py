"""The engine pod template: container, resources, probes, drain hook, shm, security, scrape annotations."""

from __future__ import annotations

from typing import Any

from kvpilot.engine.contracts.args import KV_PORT_OFFSET
from kvpilot.operator.api.common import Overrides
from kvpilot.operator.planning.placement import PodPlacement
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.engine_args import serve_args
from kvpilot.operator.render.meta import ENGINE_PORT, RENDEZVOUS_PORT, RenderConfig
from kvpilot.operator.render.weights import ModelLocation, model_location, weight_init_containers

# Resource the NVIDIA network operator's RDMA shared device plugin advertises by default.
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
# preStop pause so Services and the router stop sending before SIGTERM starts the drain.
PRESTOP_SLEEP_SECONDS = 5
# The engine loads weights before /health answers; big models need minutes.
STARTUP_BUDGET_SECONDS = 1800
KV_TRANSFER_PORT = ENGINE_PORT + KV_PORT_OFFSET  # where the engine puts it by default


def pod_template(pool: ResolvedPool, labels: dict[str, str], config: RenderConfig,
                 extra_env: list[dict[str, Any]] | None = None,
                 annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """Gives a PodTemplateSpec running `kvpilot serve` for one resolved pool."""
    overrides, placement = pool.overrides, pool.placement
    location = model_location(pool.model, pool.model_ref)
    volumes, mounts = _volumes(placement, location)
    container: dict[str, Any] = {
        "name": "engine",
        "image": overrides.image or config.engine_image,
        "command": ["kvpilot", "serve"],
        "args": serve_args(pool, config.drain_timeout_seconds),
        "ports": _ports(placement),
        "env": _env(pool, extra_env),
        "resources": _resources(pool.overrides, placement),
        "volumeMounts": mounts,
        "startupProbe": _probe("/health", period=10, failures=STARTUP_BUDGET_SECONDS // 10),
        "readinessProbe": _probe("/ready", period=5, failures=2),
        "livenessProbe": _probe("/health", period=10, failures=3),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security(placement.rdma),
    }
    if overrides.image_pull_policy:
        container["imagePullPolicy"] = overrides.image_pull_policy
    pod: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # SIGTERM starts the drain; Kubernetes must not SIGKILL before it can finish.
        "terminationGracePeriodSeconds": config.drain_timeout_seconds + PRESTOP_SLEEP_SECONDS + 15,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                            "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
    }
    init = weight_init_containers(location, pool.model, container["image"], overrides.env,
                                  _container_security(False))
    if init:
        pod["initContainers"] = init
    if overrides.node_selector:
        pod["nodeSelector"] = dict(overrides.node_selector)
    tolerations = [*placement.tolerations, *overrides.tolerations]
    if tolerations:
        pod["tolerations"] = tolerations
    affinity = _affinity(placement.node_selector_terms, overrides.affinity)
    if affinity:
        pod["affinity"] = affinity
    if overrides.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in overrides.image_pull_secrets]
    if overrides.service_account_name:
        pod["serviceAccountName"] = overrides.service_account_name
    pod_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        **(annotations or {}),
        **overrides.annotations,
    }
    return {"metadata": {"labels": {**overrides.labels, **labels},
                         "annotations": pod_annotations},
            "spec": pod}


def _affinity(terms: list[list[dict[str, Any]]],
              user: dict[str, Any] | None) -> dict[str, Any] | None:
    """Gives the pod affinity: the user's, with the accelerator's node terms ANDed into it."""
    affinity = dict(user or {})
    if not terms:
        return affinity or None
    node = dict(affinity.get("nodeAffinity") or {})
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    user_terms = required.get("nodeSelectorTerms") or [{}]
    # Terms are ORed and expressions inside one term ANDed: every combination of a user
    # term and an accelerator term must hold both sets of expressions.
    combined = [{**u, "matchExpressions": [*u.get("matchExpressions", []), *t]}
                for u in user_terms for t in terms]
    node["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": combined}
    affinity["nodeAffinity"] = node
    return affinity


def _ports(placement: PodPlacement) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
             {"name": "kv-transfer", "containerPort": KV_TRANSFER_PORT, "protocol": "TCP"}]
    if placement.nodes_per_replica > 1:
        ports.append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    return ports


def _env(pool: ResolvedPool, extra_env: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    secret = pool.model.secret_ref
    if secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {
            "secretKeyRef": {"name": secret.name, "key": secret.key}}})
    env += extra_env or []
    taken = {e["name"] for e in env}
    plain = {**pool.placement.env, **pool.overrides.env}
    env += [{"name": k, "value": v} for k, v in sorted(plain.items()) if k not in taken]
    return env


def _resources(overrides: Overrides, placement: PodPlacement) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": "1", "memory": "2Gi"}
    limits: dict[str, Any] = {}
    devices: dict[str, Any] = {}
    if placement.gpu_resource:
        devices[placement.gpu_resource] = str(placement.gpus_per_pod)
    if placement.rdma:
        devices[RDMA_RESOURCE] = "1"
    extras = overrides.resources
    requests.update({k: str(v) for k, v in extras.requests.items()})
    limits.update({k: str(v) for k, v in extras.limits.items()})
    # Extended resources cannot be overcommitted: requests must equal limits.
    requests.update(devices)
    limits.update(devices)
    out: dict[str, Any] = {"requests": requests}
    if limits:
        out["limits"] = limits
    return out


def _volumes(placement: PodPlacement,
             location: ModelLocation) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": placement.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"},
                                    {"name": "tmp", "mountPath": "/tmp"}]
    if location.volume is not None and location.mount_path is not None:
        # The engine only reads the weights, whoever writes them (an init container, a Job).
        volumes.append(location.volume)
        mounts.append({"name": "model", "mountPath": location.mount_path, "readOnly": True})
    return volumes, mounts


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _container_security(rdma: bool) -> dict[str, Any]:
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if rdma:
        # Pinning RDMA buffers needs IPC_LOCK; nothing else is added back.
        capabilities["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
            "capabilities": capabilities, "seccompProfile": {"type": "RuntimeDefault"}}
