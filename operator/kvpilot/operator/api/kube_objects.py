"""Kubernetes objects that overrides embed (Toleration, Affinity), typed as Kubernetes defines
them (core/v1), so a wrong shape is refused naming its field before any Deployment is applied.

Their schemas are not in the CRDs: the InferenceModel's CRD carries three copies of
`overrides` and is within a few bytes of the 64 KiB budget (`tests/operator_api/
test_crds.py`); Affinity alone would add kilobytes per copy. The CRDs keep them as
free-form objects (`x-kubernetes-preserve-unknown-fields`) and the operator's admission
check (the same pydantic models, in the render thread and `kvpilot up`) refuses a wrong
one, with the InferenceModel or pool ending Degraded and nothing applied (decision 0101).
Field names, enums and bounds are those of the Kubernetes API reference (v1.31).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, WithJsonSchema, model_validator

from kvpilot.operator.api.base import ApiModel

# what the CRDs keep for these fields (see the module doc): an object without properties,
# which `schema.structural` marks x-kubernetes-preserve-unknown-fields
FREE_FORM = WithJsonSchema({"type": "object"})

NodeOperator = Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
LabelOperator = Literal["In", "NotIn", "Exists", "DoesNotExist"]


class Toleration(ApiModel):
    """core/v1 Toleration: which taints the pod tolerates."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> Toleration:
        if self.operator == "Exists" and self.value:
            raise ValueError(f"value={self.value!r} with operator Exists: Kubernetes refuses "
                             "a value there; drop it or use operator Equal")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only: set that "
                             "effect or drop tolerationSeconds")
        return self


class NodeSelectorRequirement(ApiModel):
    """core/v1 NodeSelectorRequirement."""

    key: str = Field(min_length=1)
    operator: NodeOperator
    values: list[str] | None = None


class NodeSelectorTerm(ApiModel):
    """core/v1 NodeSelectorTerm: its requirements are ANDed."""

    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(ApiModel):
    """core/v1 NodeSelector: its terms are ORed."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1)


class PreferredSchedulingTerm(ApiModel):
    """core/v1 PreferredSchedulingTerm."""

    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ApiModel):
    """core/v1 NodeAffinity."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None \
        = None


class LabelSelectorRequirement(ApiModel):
    """meta/v1 LabelSelectorRequirement."""

    key: str = Field(min_length=1)
    operator: LabelOperator
    values: list[str] | None = None


class LabelSelector(ApiModel):
    """meta/v1 LabelSelector."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None


class PodAffinityTerm(ApiModel):
    """core/v1 PodAffinityTerm."""

    topology_key: str = Field(min_length=1)
    label_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    namespaces: list[str] | None = None
    match_label_keys: list[str] | None = None
    mismatch_label_keys: list[str] | None = None


class WeightedPodAffinityTerm(ApiModel):
    """core/v1 WeightedPodAffinityTerm."""

    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ApiModel):
    """core/v1 PodAffinity (also the shape of PodAntiAffinity)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None \
        = None


class Affinity(ApiModel):
    """core/v1 Affinity."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


TolerationObject = Annotated[Toleration, FREE_FORM]
AffinityObject = Annotated[Affinity, FREE_FORM]
