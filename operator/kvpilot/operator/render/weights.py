"""Where an engine pod finds its weights: the `model` volume, its mount, and the init container
that downloads (hf://) or waits for a shared cache (hf:// with spec.model.cache).

| source              | volume `model`                       | init container            | --model            |
|---------------------|--------------------------------------|---------------------------|--------------------|
| dummy:NAME          | none                                 | none                      | NAME               |
| pvc://claim/path    | the claim, read-only                 | none                      | /models/claim/path |
| oci://image         | an image volume (Kubernetes 1.33+)   | none                      | /models/oci/models |
| hf://org/name       | emptyDir                             | fetch-model: downloads    | /models/hf         |
| hf:// + cache       | the cache claim, read-only           | wait-for-weights: waits   | /models/hf         |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api.common import ModelSource
from kvpilot.operator.render.meta import child_name
from kvpilot.operator.weights.request import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, FetchRequest

MODEL_DIR = "/models"
HF_DIR = f"{MODEL_DIR}/hf"
OCI_DIR = f"{MODEL_DIR}/oci"
OCI_WEIGHTS = "models"  # KServe's modelcar layout: the image holds the files under /models
FETCH_CONTAINER = "fetch-model"
WAIT_CONTAINER = "wait-for-weights"
# huggingface_hub writes its token and lock files under HF_HOME; /tmp is the writable emptyDir.
FETCH_HF_HOME = "/tmp/huggingface"


@dataclass(frozen=True)
class ModelLocation:
    """Where the engine finds its weights inside the pod, and what puts them there."""

    engine_model: str
    """Value of `--model`: a built-in config name or a directory in the pod."""
    load_format: str
    """auto or dummy."""
    volume: dict[str, Any] | None = None
    """The pod volume named `model` (None: the built-in configs need none)."""
    mount_path: str | None = None
    read_only: bool = True
    fetch: FetchRequest | None = None
    """What an hf:// source downloads."""
    cache_claim: str | None = None
    """The claim a weights Job fills (hf:// with spec.model.cache); pods only wait for it."""


def fetch_request(model: ModelSource) -> FetchRequest:
    """Gives the Hub download of an hf:// model: repository, revision and file filters."""
    return FetchRequest(
        model.source.removeprefix("hf://"), model.revision,
        tuple(model.include) if model.include is not None else DEFAULT_INCLUDE,
        tuple(model.exclude) if model.exclude is not None else DEFAULT_EXCLUDE)


def cache_claim_name(owner: str, request: FetchRequest) -> str:
    """Gives the name of an InferenceModel's weight cache: one per repository, revision and
    filters, so a new revision fills a new claim while the old one still serves."""
    return child_name(owner, "weights", request.key())


def model_location(model: ModelSource, owner: str | None = None) -> ModelLocation:
    """Gives where `spec.model` ends up inside the pod; `owner` names the InferenceModel whose
    cache an hf:// source with spec.model.cache uses (required then)."""
    source = model.source
    if source.startswith("dummy:"):
        return ModelLocation(source.removeprefix("dummy:"), "dummy")
    if source.startswith("pvc://"):
        claim, _, path = source.removeprefix("pvc://").partition("/")
        return ModelLocation(f"{MODEL_DIR}/{claim}/{path}".rstrip("/"), "auto",
                             {"name": "model", "persistentVolumeClaim": {
                                 "claimName": claim, "readOnly": True}}, f"{MODEL_DIR}/{claim}")
    if source.startswith("oci://"):
        image = {"reference": source.removeprefix("oci://"), "pullPolicy": "IfNotPresent"}
        return ModelLocation(f"{OCI_DIR}/{OCI_WEIGHTS}", "auto",
                             {"name": "model", "image": image}, OCI_DIR)
    if source.startswith("hf://"):
        request = fetch_request(model)
        if model.cache is None:
            return ModelLocation(HF_DIR, "auto", {"name": "model", "emptyDir": {}}, HF_DIR,
                                 read_only=False, fetch=request)
        if owner is None:
            raise ValueError(
                f"spec.model.cache is set on a pool with an inline spec.model ({source}): the "
                "cache is filled by an InferenceModel's Job; reference an InferenceModel "
                "(spec.modelRef), or remove cache to download in each pod")
        claim = cache_claim_name(owner, request)
        return ModelLocation(HF_DIR, "auto", {"name": "model", "persistentVolumeClaim": {
            "claimName": claim, "readOnly": True}}, HF_DIR, fetch=request, cache_claim=claim)
    raise ValueError(f"spec.model.source={source!r} is not supported: write hf://org/name, "
                     "pvc://claim/path, oci://registry/image:tag or dummy:tiny-llama")


def fetch_args(request: FetchRequest, local_dir: str, wait: bool = False) -> list[str]:
    """Gives the `kvpilot fetch` command line of `request` into `local_dir` (filters explicit,
    so the pod spec shows exactly what is downloaded)."""
    args = ["kvpilot", "fetch", request.repo]
    if request.revision:
        args += ["--revision", request.revision]
    args += ["--include", *request.include, "--exclude", *request.exclude,
             "--local-dir", local_dir]
    return [*args, "--wait"] if wait else args


def fetch_env(model: ModelSource, user_env: dict[str, str]) -> list[dict[str, Any]]:
    """Gives the environment of a download: HF_TOKEN from spec.model.secretRef, the user's
    HF_* variables (HF_ENDPOINT for a mirror), and a writable HF_HOME."""
    env: list[dict[str, Any]] = []
    if model.secret_ref is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": model.secret_ref.name, "key": model.secret_ref.key}}})
    hub = {"HF_HOME": FETCH_HF_HOME, **{k: v for k, v in user_env.items()
                                        if k.startswith("HF_") and k != "HF_TOKEN"}}
    return env + [{"name": k, "value": v} for k, v in sorted(hub.items())]


def weight_init_containers(location: ModelLocation, model: ModelSource, image: str,
                           user_env: dict[str, str],
                           security: dict[str, Any]) -> list[dict[str, Any]]:
    """Gives the init container that puts the weights in place before the engine starts."""
    if location.fetch is None or location.mount_path is None:
        return []
    wait = location.cache_claim is not None
    return [{
        "name": WAIT_CONTAINER if wait else FETCH_CONTAINER, "image": image,
        "command": fetch_args(location.fetch, location.mount_path, wait=wait),
        "env": fetch_env(model, user_env),
        "volumeMounts": [{"name": "model", "mountPath": location.mount_path,
                          "readOnly": location.read_only},
                         {"name": "tmp", "mountPath": "/tmp"}],
        # The last log lines become the termination message the operator shows on failure.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security,
    }]
