"""Where each kind of model source puts the weights in an engine pod, and the weight cache."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool
from kvpilot.operator.weights.request import DEFAULT_EXCLUDE, DEFAULT_INCLUDE

IM = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
      "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1}}
REPO = "meta-llama/Llama-3.1-8B-Instruct"
DEFAULT_FILTERS = ["--include", *DEFAULT_INCLUDE, "--exclude", *DEFAULT_EXCLUDE]


def spec(**model: Any) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate({"model": {"name": "chat", **model},
                                              "accelerator": {"vendor": "cpu"}})


def children(model_spec: InferenceModelSpec) -> list[dict[str, Any]]:
    return render_children(IM, model_spec, owned_pools(model_spec, "chat"), RenderConfig())


def deployment(model_spec: InferenceModelSpec) -> dict[str, Any]:
    """Gives the Deployment of the InferenceModel's decode pool."""
    stored = next(o for o in children(model_spec) if o["kind"] == "DecodePool")
    resolved = resolve_pool(DecodePoolSpec.model_validate(stored["spec"]), model_spec)
    objects = render_pool({**stored, "metadata": {**stored["metadata"], "uid": "p1"}}, resolved,
                          RenderConfig())
    return next(o for o in objects if o["kind"] == "Deployment")


def pod(model_spec: InferenceModelSpec) -> dict[str, Any]:
    """Gives the engine pod spec of the InferenceModel's decode pool."""
    return deployment(model_spec)["spec"]["template"]["spec"]


def model_volume(pod_spec: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in pod_spec["volumes"] if v["name"] == "model"), None)


def engine_mount(pod_spec: dict[str, Any]) -> dict[str, Any] | None:
    mounts = pod_spec["containers"][0]["volumeMounts"]
    return next((m for m in mounts if m["name"] == "model"), None)


def served(pod_spec: dict[str, Any]) -> str:
    args = pod_spec["containers"][0]["args"]
    return args[args.index("--model") + 1]


@pytest.mark.parametrize(("model", "volume", "mount", "model_dir", "init"), [
    ({"source": "dummy:tiny-llama"}, None, None, "tiny-llama", []),
    ({"source": "pvc://weights/llama/8b"},
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
     "/models/weights", "/models/weights/llama/8b", []),
    ({"source": "pvc://weights"},
     {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
     "/models/weights", "/models/weights", []),
    ({"source": "oci://ghcr.io/acme/llama-8b:v1"},
     {"name": "model", "image": {"reference": "ghcr.io/acme/llama-8b:v1",
                                 "pullPolicy": "IfNotPresent"}},
     "/models/oci", "/models/oci/models", []),
    ({"source": f"hf://{REPO}"}, {"name": "model", "emptyDir": {}}, "/models/hf", "/models/hf",
     [("fetch-model", ["kvpilot", "fetch", REPO, *DEFAULT_FILTERS, "--local-dir",
                       "/models/hf"])]),
    ({"source": f"hf://{REPO}", "revision": "0e9e39f", "include": ["*.safetensors"],
      "exclude": []}, {"name": "model", "emptyDir": {}}, "/models/hf", "/models/hf",
     [("fetch-model", ["kvpilot", "fetch", REPO, "--revision", "0e9e39f", "--include",
                       "*.safetensors", "--exclude", "--local-dir", "/models/hf"])]),
])
def test_each_source_puts_the_weights_in_place(model, volume, mount, model_dir, init):
    pod_spec = pod(spec(**model))
    assert model_volume(pod_spec) == volume
    assert (engine_mount(pod_spec) or {}).get("mountPath") == mount
    if mount is not None:
        assert engine_mount(pod_spec)["readOnly"] is True  # the engine never writes weights
    assert served(pod_spec) == model_dir
    got = [(c["name"], c["command"]) for c in pod_spec.get("initContainers", [])]
    assert got == init
    kubernetes_validate.validate(deployment(spec(**model)), "1.34", strict=True)


def test_the_download_gets_the_token_and_the_users_hub_settings_only():
    model_spec = InferenceModelSpec.model_validate({
        "model": {"name": "chat", "source": f"hf://{REPO}",
                  "secretRef": {"name": "hf", "key": "token"}},
        "accelerator": {"vendor": "cpu"},
        "overrides": {"env": {"HF_ENDPOINT": "http://mirror:8080", "NCCL_DEBUG": "INFO"}}})
    fetch = pod(model_spec)["initContainers"][0]
    assert fetch["env"] == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "HF_ENDPOINT", "value": "http://mirror:8080"},
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
    ]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {m["mountPath"]: m.get("readOnly", False) for m in fetch["volumeMounts"]} == {
        "/models/hf": False, "/tmp": False}


CACHE = {"size": "40Gi", "storageClassName": "nfs"}


def test_a_cache_is_one_claim_filled_by_one_job_and_mounted_read_only():
    model_spec = spec(source=f"hf://{REPO}", revision="main", cache=CACHE)
    objects = children(model_spec)
    claim = next(o for o in objects if o["kind"] == "PersistentVolumeClaim")
    job = next(o for o in objects if o["kind"] == "Job")
    name = claim["metadata"]["name"]
    assert name.startswith("chat-weights-")
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                             "resources": {"requests": {"storage": "40Gi"}}}
    assert job["metadata"]["labels"]["kvpilot.dev/weights"] == name
    job_pod = job["spec"]["template"]["spec"]
    assert job_pod["containers"][0]["command"] == [
        "kvpilot", "fetch", REPO, "--revision", "main", *DEFAULT_FILTERS,
        "--local-dir", "/models/hf"]
    assert job_pod["volumes"][0] == {"name": "model", "persistentVolumeClaim": {"claimName": name}}
    assert job_pod["securityContext"]["fsGroup"] == 1000
    for obj in (claim, job):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u1"
        kubernetes_validate.validate(obj, "1.34", strict=True)
    engine = pod(model_spec)
    assert model_volume(engine) == {"name": "model", "persistentVolumeClaim": {
        "claimName": name, "readOnly": True}}
    wait = engine["initContainers"][0]
    assert (wait["name"], wait["command"][-1]) == ("wait-for-weights", "--wait")
    assert wait["volumeMounts"][0] == {"name": "model", "mountPath": "/models/hf",
                                       "readOnly": True}


def test_the_cache_is_keyed_by_revision_and_filters_and_the_job_by_its_template():
    def names(**model: Any) -> tuple[str, str]:
        objects = children(spec(source=f"hf://{REPO}", cache=CACHE, **model))
        return tuple(next(o["metadata"]["name"] for o in objects if o["kind"] == kind)
                     for kind in ("PersistentVolumeClaim", "Job"))  # type: ignore[return-value]

    base = names(revision="a")
    assert names(revision="a") == base  # stable across reconciles
    assert names(revision="b")[0] != base[0]
    assert names(revision="a", include=["*.safetensors", "*.json"])[0] != base[0]
    secret = names(revision="a", secretRef={"name": "hf"})
    assert secret[0] == base[0] and secret[1] != base[1]  # same files, a new immutable Job


def test_no_cache_objects_without_a_cache():
    kinds = {o["kind"] for o in children(spec(source=f"hf://{REPO}"))}
    assert not kinds & {"PersistentVolumeClaim", "Job"}


def test_a_cache_on_an_inline_pool_is_refused_naming_the_field():
    pool = DecodePoolSpec.model_validate({"model": {"name": "x", "source": f"hf://{REPO}",
                                                    "cache": CACHE}})
    resolved = resolve_pool(pool, None)
    with pytest.raises(ValueError, match=r"spec.model.cache is set on a pool with an inline"):
        render_pool({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "DecodePool",
                     "metadata": {"name": "x", "namespace": "ns", "uid": "p"},
                     "spec": pool.to_json()}, resolved, RenderConfig())
