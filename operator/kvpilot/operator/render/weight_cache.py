"""An InferenceModel's shared weight cache: a PersistentVolumeClaim and the Job that fills it once.

Engine pods mount the claim read-only and wait (init container `wait-for-weights`) for
the marker the Job writes when the download is complete, so N replicas and every restart
read one copy (KServe's LocalModelCache is the anchor). The claim is keyed by repository,
revision and filters: a new revision fills a new claim while pods of the old one still
serve, and the old claim is pruned once nothing renders it (Kubernetes keeps it until the
last pod using it is gone). The Job's name also carries a digest of its pod template, which
Kubernetes does not let anyone change: a new image or token Secret gets a new Job, which
finds the marker and exits at once when the files are already there.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvpilot.operator.api.common import ModelSource
from kvpilot.operator.render.meta import MODEL_LABEL, RenderConfig, child_name, object_meta
from kvpilot.operator.render.weights import HF_DIR, fetch_args, fetch_env, fetch_request
from kvpilot.operator.weights.cli import EXIT_FIX_THE_SPEC

WEIGHTS_LABEL = "kvpilot.dev/weights"
"""On the cache claim, its Job and the Job's pods: the claim's name."""
JOB_BACKOFF_LIMIT = 6  # each retry resumes the partial files on the claim
JOB_CONTAINER = "fetch-model"
FAILURE_POLICY = {"rules": [
    # `kvpilot fetch` exits 2 when only a spec change helps (gated, no such revision, no file
    # matches): fail the Job now rather than after every backoff.
    {"action": "FailJob", "onExitCodes": {"containerName": JOB_CONTAINER, "operator": "In",
                                          "values": [EXIT_FIX_THE_SPEC]}},
    # An evicted or preempted pod is not the download's fault: retry without counting it.
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
]}


def weight_cache(owner: dict[str, Any], model: ModelSource, claim: str,
                 config: RenderConfig, user_env: dict[str, str]) -> list[dict[str, Any]]:
    """Gives the claim `claim` and the Job that downloads `model` into it, owned by `owner`."""
    cache = model.cache
    if cache is None:
        raise ValueError("weight_cache needs spec.model.cache")
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    labels = {MODEL_LABEL: name, WEIGHTS_LABEL: claim}
    pvc_spec: dict[str, Any] = {"accessModes": [cache.access_mode],
                                "resources": {"requests": {"storage": cache.size}}}
    if cache.storage_class_name:
        pvc_spec["storageClassName"] = cache.storage_class_name
    claim_object = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": object_meta(claim, namespace, labels, owner), "spec": pvc_spec}
    template = _job_pod(model, claim, config, user_env, labels)
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:6]
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": object_meta(job_name(claim, digest), namespace, labels, owner),
           "spec": {"backoffLimit": JOB_BACKOFF_LIMIT, "podFailurePolicy": FAILURE_POLICY,
                    "template": template}}
    return [claim_object, job]


def job_name(claim: str, digest: str) -> str:
    """Gives the name of the Job that fills `claim` with the pod template of `digest`."""
    return child_name(claim, digest)


def _job_pod(model: ModelSource, claim: str, config: RenderConfig, user_env: dict[str, str],
             labels: dict[str, str]) -> dict[str, Any]:
    security = {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    container = {
        "name": JOB_CONTAINER,
        # The operator image: torch-free and small, it carries `kvpilot fetch` too.
        "image": config.router_image,
        "command": fetch_args(fetch_request(model), HF_DIR),
        "env": fetch_env(model, user_env),
        "volumeMounts": [{"name": "model", "mountPath": HF_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"},
                      "limits": {"memory": "4Gi"}},
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security,
    }
    return {"metadata": {"labels": dict(labels)},
            "spec": {"restartPolicy": "Never", "containers": [container],
                     "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": claim}},
                                 {"name": "tmp", "emptyDir": {}}],
                     # fsGroup makes the claim writable for the non-root downloader.
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 1000,
                                         "runAsGroup": 1000, "fsGroup": 1000,
                                         "seccompProfile": {"type": "RuntimeDefault"}},
                     "enableServiceLinks": False}}
