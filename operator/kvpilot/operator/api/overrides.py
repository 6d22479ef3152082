"""The pod settings users may change (`overrides`): image, resources, placement, env, metadata."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.formats import (
    AnnotationMap,
    DnsSubdomain,
    EnvMap,
    LabelMap,
    Quantity,
    parse_quantity,
)
from kvpilot.operator.api.kube_objects import AffinityObject, TolerationObject

# Checked by the operator, not by a CEL rule: the quantity() cost of int-or-string values
# has no bound the API server could estimate.
REQUESTS_WITHIN_LIMITS = ("a request above its limit makes every pod invalid: lower "
                          "resources.requests or raise resources.limits")


class ResourceExtras(ApiModel):
    """Resources added to the engine container on top of the GPUs the topology needs."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    """Extra requests, e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    """Extra limits, e.g. {memory: 128Gi}; memory defaults to the model's needs when unset."""

    @model_validator(mode="after")
    def _requests_within_limits(self) -> ResourceExtras:
        for name, request in self.requests.items():
            limit = self.limits.get(name)
            if limit is not None and parse_quantity(request) > parse_quantity(limit):
                raise ValueError(f"resources.requests.{name}={request} > resources.limits."
                                 f"{name}={limit}: {REQUESTS_WITHIN_LIMITS}")
        return self


# Container fields users reach for that the operator renders from the spec: refused naming
# what renders them (pydantic alone would say "extra inputs are not permitted").
RENDERED_BY_OPERATOR = {
    "command": "the engine's command (kvpilot serve with the spec's flags); engine flags go "
               "in engine.extraArgs",
    "args": "the engine's flags, from spec.engine; more flags go in engine.extraArgs",
    "ports": "the engine's ports (http 8000, kv-transfer 9000, the rendezvous port)",
    "livenessProbe": "the engine's probes (GET /health on port http)",
    "readinessProbe": "the engine's probes (GET /ready on port http)",
    "startupProbe": "the engine's probes (GET /health on port http)",
}


class Overrides(ApiModel):
    """The curated part of the pod users may change; no full PodSpec on purpose (small CRDs)."""

    image: str | None = Field(default=None, max_length=512)
    """Engine image (default: the operator's --engine-image)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Pull policy of the engine image."""
    image_pull_secrets: list[DnsSubdomain] = Field(default_factory=list, max_length=16)
    """Names of Secrets for pulling the image."""
    resources: ResourceExtras = Field(default_factory=ResourceExtras,
                                      json_schema_extra={"default": {}})
    """Extra CPU, memory or other resources."""
    node_selector: LabelMap = Field(default_factory=dict)
    """Labels nodes must carry, merged with the accelerator's own."""
    tolerations: list[TolerationObject] = Field(default_factory=list, max_length=32)
    """Pod tolerations (Kubernetes Toleration objects), added to the accelerator's."""
    affinity: AffinityObject | None = None
    """Pod affinity (a Kubernetes Affinity object), used as given."""
    env: EnvMap = Field(default_factory=dict)
    """Extra environment variables of the engine container."""
    annotations: AnnotationMap = Field(default_factory=dict)
    """Extra pod annotations."""
    labels: LabelMap = Field(default_factory=dict)
    """Extra pod labels."""
    service_account_name: DnsSubdomain | None = None
    """Service account of the engine pods (they mount no API token either way)."""

    @model_validator(mode="before")
    @classmethod
    def _not_rendered_by_operator(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, rendered in RENDERED_BY_OPERATOR.items():
                if key in data:
                    raise ValueError(f"overrides.{key} contradicts {rendered}, which the "
                                     f"operator renders: remove overrides.{key}")
        return data
