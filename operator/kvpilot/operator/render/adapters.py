"""Where an engine pod finds its LoRA adapters, and the `--enable-lora` flags that name them.

| source            | volume                                   | init container          | path in the pod                 |
|-------------------|------------------------------------------|-------------------------|---------------------------------|
| hf://org/name     | `adapters` (one emptyDir for all)         | fetch-adapter-NAME      | /adapters/NAME                  |
| pvc://claim/path  | `adapter-claim-K`, the claim read-only    | none                    | /adapter-claims/claim/path      |
| oci://image       | `adapter-NAME`, an image volume           | none                    | /adapter-images/NAME/models     |

hf:// adapters download like hf:// base weights without a cache (`kvpilot fetch`, the same
default file filters, spec.model.secretRef's token), one init container each; adapters are
megabytes, so each pod fetches its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.operator.api.adapters import DEFAULT_MAX_LORAS, AdapterSpec
from kvpilot.operator.api.common import EngineSpec, ModelSource
from kvpilot.operator.render.weights import OCI_WEIGHTS, fetch_args, fetch_env
from kvpilot.operator.weights.request import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, FetchRequest

HF_ADAPTERS_DIR = "/adapters"
CLAIMS_DIR = "/adapter-claims"
IMAGES_DIR = "/adapter-images"
HF_ADAPTER_SIZE_GIB = 2  # the emptyDir's share per hf:// adapter (ranks up to 512 of a 70B fit)
LORA_FLAGS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank")
"""The engine flags this module renders (the operator owns them: not in extraArgs)."""


def engine_serves_lora() -> bool:
    """Gives whether this kvpilot's engine takes the LoRA flags (`--enable-lora` ...)."""
    return set(LORA_FLAGS) <= {f.name for f in fields(EngineArgs)}


@dataclass(frozen=True)
class AdapterLocation:
    """Where one adapter's PEFT directory is inside the pod, and what puts it there."""

    name: str
    path: str
    """The directory `--lora-modules name=path` names."""
    volume: dict[str, Any] | None = None
    """A volume only this adapter needs (an image or a claim); None: shared or already there."""
    mount_path: str | None = None
    fetch: FetchRequest | None = None
    """The Hub download of an hf:// adapter."""


def adapter_locations(adapters: Sequence[AdapterSpec]) -> list[AdapterLocation]:
    """Gives where each adapter ends up in the pod, in spec order (a claim mounted once)."""
    out: list[AdapterLocation] = []
    claims: list[str] = []
    for adapter in adapters:
        source = adapter.source
        if source.startswith("hf://"):
            request = FetchRequest(source.removeprefix("hf://"), adapter.revision,
                                   DEFAULT_INCLUDE, DEFAULT_EXCLUDE)
            out.append(AdapterLocation(adapter.name, f"{HF_ADAPTERS_DIR}/{adapter.name}",
                                       fetch=request))
        elif source.startswith("pvc://"):
            claim, _, path = source.removeprefix("pvc://").partition("/")
            volume = None
            if claim not in claims:
                claims.append(claim)
                volume = {"name": f"adapter-claim-{len(claims) - 1}", "persistentVolumeClaim": {
                    "claimName": claim, "readOnly": True}}
            out.append(AdapterLocation(adapter.name, f"{CLAIMS_DIR}/{claim}/{path}".rstrip("/"),
                                       volume, f"{CLAIMS_DIR}/{claim}"))
        else:  # oci://, the only other scheme ADAPTER_SOURCE admits
            image = {"reference": source.removeprefix("oci://"), "pullPolicy": "IfNotPresent"}
            mount = f"{IMAGES_DIR}/{adapter.name}"
            out.append(AdapterLocation(adapter.name, f"{mount}/{OCI_WEIGHTS}",
                                       {"name": f"adapter-{adapter.name}", "image": image}, mount))
    return out


def adapter_volumes(adapters: Sequence[AdapterSpec]
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Gives the pod volumes and the engine's read-only mounts of the adapters."""
    locations = adapter_locations(adapters)
    volumes = [loc.volume for loc in locations if loc.volume is not None]
    mounts = [{"name": loc.volume["name"], "mountPath": loc.mount_path, "readOnly": True}
              for loc in locations if loc.volume is not None]
    fetched = sum(loc.fetch is not None for loc in locations)
    if fetched:
        volumes.append({"name": "adapters", "emptyDir": {
            "sizeLimit": f"{fetched * HF_ADAPTER_SIZE_GIB}Gi"}})
        mounts.append({"name": "adapters", "mountPath": HF_ADAPTERS_DIR, "readOnly": True})
    return volumes, mounts


def adapter_init_containers(adapters: Sequence[AdapterSpec], model: ModelSource, image: str,
                            user_env: dict[str, str], security: dict[str, Any],
                            resources: dict[str, Any]) -> list[dict[str, Any]]:
    """Gives one init container per hf:// adapter, downloading it before the engine starts."""
    return [{
        "name": f"fetch-adapter-{loc.name}", "image": image,
        "command": fetch_args(loc.fetch, loc.path),
        "env": fetch_env(model, user_env),
        "volumeMounts": [{"name": "adapters", "mountPath": HF_ADAPTERS_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": resources,
        "securityContext": security,
    } for loc in adapter_locations(adapters) if loc.fetch is not None]


def lora_args(adapters: Sequence[AdapterSpec], engine: EngineSpec) -> list[str]:
    """Gives `--enable-lora --lora-modules name=path ... --max-loras N [--max-lora-rank R]`, or
    nothing without adapters; raises ValueError naming spec.adapters when the engine has no
    LoRA."""
    if not adapters:
        return []
    if not engine_serves_lora():
        raise ValueError(f"spec.adapters={[a.name for a in adapters]}: this kvpilot's engine "
                         "has no LoRA flags (--enable-lora, --lora-modules): upgrade kvpilot, "
                         "or remove spec.adapters")
    modules = [f"{loc.name}={loc.path}" for loc in adapter_locations(adapters)]
    max_loras = engine.max_loras or min(len(adapters), DEFAULT_MAX_LORAS)
    args = ["--enable-lora", "--lora-modules", *modules, "--max-loras", str(max_loras)]
    if engine.max_lora_rank is not None:
        args += ["--max-lora-rank", str(engine.max_lora_rank)]
    return args
