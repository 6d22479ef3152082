"""The engine pod template: container, probes, drain hook, volumes, security, scrape annotations.

Hardened: non-root, no privilege escalation, every capability dropped (RDMA adds back
IPC_LOCK only), a read-only root filesystem with size-limited emptyDirs where the engine
writes (/cache: the image's HOME, HF_HOME and TRITON_CACHE_DIR; /tmp; /dev/shm; the
downloaded weights; with `--compile-cache-dir` a node directory over TRITON_CACHE_DIR, so
compiled kernels outlive the pod), no service-account token (engines never call the API server). The
init container that downloads or waits for the weights (render/weights.py) gets the same.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.contracts.args import KV_PORT_OFFSET
from kvpilot.operator.api.speculative import DRAFT_DIR
from kvpilot.operator.planning.placement import PodPlacement
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.render.adapters import adapter_init_containers, adapter_volumes
from kvpilot.operator.render.engine_args import serve_args
from kvpilot.operator.render.fleet import FLEET_MOUNT, api_key_env, fleet_volume
from kvpilot.operator.render.meta import ENGINE_PORT, MODEL_LABEL, RENDEZVOUS_PORT, RenderConfig
from kvpilot.operator.render.resources import FETCH_RESOURCES, engine_resources, gib, weight_bytes
from kvpilot.operator.render.weights import ModelLocation, model_location, weight_init_containers

# images/engine-*.Dockerfile: HOME=/cache, HF_HOME=/cache/huggingface,
# TRITON_CACHE_DIR=/cache/triton; compiled kernels and the HF cache's small files go there.
CACHE_DIR = "/cache"
TRITON_CACHE_DIR = f"{CACHE_DIR}/triton"
CACHE_SIZE = "4Gi"
TMP_SIZE = "4Gi"
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
    volumes, mounts = _volumes(pool, location)
    volumes.append(fleet_volume(labels[MODEL_LABEL]))
    mounts.append(FLEET_MOUNT)
    if config.compile_cache_dir:  # the node's compiled kernels, over the pod's own /cache
        volumes.append({"name": "compile-cache", "hostPath": {
            "path": config.compile_cache_dir, "type": "DirectoryOrCreate"}})
        mounts.append({"name": "compile-cache", "mountPath": TRITON_CACHE_DIR})
    container: dict[str, Any] = {
        "name": "engine",
        "image": overrides.image or config.engine_image,
        "command": ["kvpilot", "serve"],
        "args": serve_args(pool, config.drain_timeout_seconds),
        "ports": _ports(placement),
        "env": _env(pool, extra_env),
        "resources": engine_resources(pool),
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
        "automountServiceAccountToken": False,
    }
    init = weight_init_containers(location, pool.model, container["image"], overrides.env,
                                  _container_security(False), FETCH_RESOURCES)
    init += adapter_init_containers(pool.adapters, pool.model, container["image"], overrides.env,
                                    _container_security(False), FETCH_RESOURCES)
    if init:
        pod["initContainers"] = init
    if overrides.node_selector:
        pod["nodeSelector"] = dict(overrides.node_selector)
    tolerations = [*placement.tolerations, *(t.to_json() for t in overrides.tolerations)]
    if tolerations:
        pod["tolerations"] = tolerations
    affinity = _affinity(placement.node_selector_terms,
                         overrides.affinity.to_json() if overrides.affinity else None)
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
    env += api_key_env(pool.auth)
    env += extra_env or []
    taken = {e["name"] for e in env}
    plain = {**pool.placement.env, **pool.overrides.env}
    env += [{"name": k, "value": v} for k, v in sorted(plain.items()) if k not in taken]
    return env


def _volumes(pool: ResolvedPool,
             location: ModelLocation) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": pool.placement.shm_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
        {"name": "cache", "emptyDir": {"sizeLimit": CACHE_SIZE}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"},
                                    {"name": "tmp", "mountPath": "/tmp"},
                                    {"name": "cache", "mountPath": CACHE_DIR}]
    if location.volume is not None and location.mount_path is not None:
        volume = location.volume
        weights = weight_bytes(pool)
        if "emptyDir" in volume and weights is not None:
            # A per-pod download: the weights plus a tenth for tokenizer, configs and the
            # download's own files.
            volume = {**volume, "emptyDir": {"sizeLimit": gib(int(weights * 1.1))}}
        # The engine only reads the weights, whoever writes them (an init container, a Job).
        volumes.append(volume)
        mounts.append({"name": "model", "mountPath": location.mount_path, "readOnly": True})
    adapter_vols, adapter_mounts = adapter_volumes(pool.adapters)
    volumes += adapter_vols
    mounts += adapter_mounts
    speculative = pool.engine.speculative
    draft = speculative.draft_claim() if speculative else None
    if draft is not None:  # a draft model on a claim: mounted beside the target's weights
        volumes.append({"name": "draft-model", "persistentVolumeClaim": {
            "claimName": draft[0], "readOnly": True}})
        mounts.append({"name": "draft-model", "mountPath": f"{DRAFT_DIR}/{draft[0]}",
                       "readOnly": True})
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
            "readOnlyRootFilesystem": True, "capabilities": capabilities,
            "seccompProfile": {"type": "RuntimeDefault"}}
