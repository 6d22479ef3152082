"""The PrefillPool and DecodePool kinds: a set of identical engine replicas of one role."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.access import AuthSpec, NetworkPeer
from kvpilot.operator.api.autoscaling import AutoscalingSpec
from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.common import (
    TP_FITS_NODE,
    CommunicationSpec,
    EngineSpec,
    ModelSource,
    ScaleDecision,
    TopologySpec,
    check_fits_node,
)
from kvpilot.operator.api.consistency import EXPERTS, check_sections, vendor_rules
from kvpilot.operator.api.names import MAX_REPLICAS
from kvpilot.operator.api.overrides import Overrides
from kvpilot.operator.api.rules import CelRule, validations
from kvpilot.operator.api.stored import ObservedStatus, StoredObject

POOL_RULES = [
    CelRule("has(self.modelRef) != has(self.model)",
            "set exactly one of spec.modelRef (name of an InferenceModel) or spec.model (inline)"),
    CelRule("!has(self.engine) || has(self.model)",
            "spec.engine goes with an inline spec.model; with spec.modelRef the InferenceModel's "
            "engine applies: remove spec.engine", ".engine"),
    CelRule("!has(self.topology) || !has(self.accelerator) || "
            "!has(self.accelerator.gpusPerNode) || "
            "self.topology.tensorParallel <= self.accelerator.gpusPerNode",
            TP_FITS_NODE, ".topology.tensorParallel"),
    *vendor_rules("self.accelerator.vendor", "!has(self.accelerator)",
                  ["self.communication.env", "self.overrides.env"],
                  "self.communication.nvlsEnable"),
    CelRule("!has(self.model) || has(self.model.numExperts) || !has(self.topology) || "
            "self.topology.expertParallel == 1", EXPERTS, ".topology.expertParallel"),
]


class PoolSpec(ApiModel):
    """Fields both pool kinds share. Unset sections come from the referenced InferenceModel
    (kvpilot.operator.planning.pool.resolve_pool fills them)."""

    model_config = ConfigDict(json_schema_extra=validations(POOL_RULES))

    model_ref: str | None = Field(default=None, min_length=1, max_length=253)
    """Name of an InferenceModel in the same namespace whose model and engine this pool serves."""
    model: ModelSource | None = None
    """Inline model, instead of modelRef."""
    engine: EngineSpec | None = None
    """Inline engine settings (only with model)."""
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    """Engine replicas; the scale subresource and the autoscaler write it."""
    topology: TopologySpec | None = None
    """Parallelism of each replica (unset: the InferenceModel's, else 1/1/1)."""
    accelerator: AcceleratorSpec | None = None
    """Devices (unset: the InferenceModel's, else nvidia)."""
    communication: CommunicationSpec | None = None
    """NCCL/RCCL settings (unset: the InferenceModel's)."""
    autoscaling: AutoscalingSpec | None = None
    """Scale on KV-cache pressure and queue depth; absent means fixed replicas."""
    overrides: Overrides | None = None
    """Pod settings (unset: the InferenceModel's)."""
    auth: AuthSpec | None = None
    """Client authentication of the engines' API (unset: the InferenceModel's)."""
    allow_from: list[NetworkPeer] | None = Field(default=None, max_length=32)
    """Who besides the InferenceModel's router and the operator may connect to the engines'
    HTTP port (NetworkPolicy peers); unset: nobody else. A pool without an InferenceModel
    has no router: name its clients here."""
    progress_deadline_seconds: int | None = Field(default=None, ge=60)
    """Seconds a replica may stay not ready before the pool reports ProgressDeadlineExceeded
    (unset: the InferenceModel's, else 3600)."""

    @model_validator(mode="after")
    def _source(self) -> PoolSpec:
        if (self.model_ref is None) == (self.model is None):
            raise ValueError(f"spec.modelRef={self.model_ref!r}, spec.model "
                             f"{'set' if self.model else 'unset'}: {POOL_RULES[0].message}")
        if self.engine is not None and self.model is None:
            raise ValueError(POOL_RULES[1].message)
        check_fits_node(self.topology, self.accelerator)
        check_sections(self.model, [self.topology], self.accelerator, self.communication,
                       [self.communication.env if self.communication else {},
                        self.overrides.env if self.overrides else {}], self.engine)
        return self


class PrefillPoolSpec(PoolSpec):
    """Desired state of a PrefillPool."""

    kind: ClassVar[Literal["PrefillPool"]] = "PrefillPool"
    role: Literal["prefill"] = "prefill"
    """Engine role: prefill computes prompt KV and hands it to a decode pool."""


class DecodePoolSpec(PoolSpec):
    """Desired state of a DecodePool."""

    kind: ClassVar[Literal["DecodePool"]] = "DecodePool"
    role: Literal["both", "decode"] = "both"
    """Engine role: both serves whole requests (aggregated); decode takes KV from prefill."""


AnyPoolSpec = PrefillPoolSpec | DecodePoolSpec
"""The spec of either pool kind."""
SPEC_BY_KIND: dict[str, type[PrefillPoolSpec] | type[DecodePoolSpec]] = {
    cls.kind: cls for cls in (PrefillPoolSpec, DecodePoolSpec)}


class PoolStatus(ObservedStatus):
    """Observed state of a pool."""

    replicas: int = Field(default=0, ge=0)
    """Replicas that exist (scale subresource)."""
    ready_replicas: int = Field(default=0, ge=0)
    """Replicas passing readiness."""
    selector: str | None = None
    """Label selector of the pool's pods, as text (scale subresource, for HPA/KEDA)."""
    kv_cache_utilization: float | None = Field(default=None, ge=0, le=1)
    """Mean fraction of KV-cache blocks in use."""
    kv_cache_percent: int | None = Field(default=None, ge=0, le=100)
    """kvCacheUtilization as a whole percentage (printer column)."""
    queue_depth: int | None = Field(default=None, ge=0)
    """Waiting requests summed over replicas."""
    last_scale_decision: ScaleDecision | None = None
    """The autoscaler's latest decision."""


class PrefillPool(StoredObject):
    """A PrefillPool object as stored by the API server."""

    kind: Literal["PrefillPool"] = "PrefillPool"
    spec: PrefillPoolSpec
    status: PoolStatus | None = None


class DecodePool(StoredObject):
    """A DecodePool object as stored by the API server."""

    kind: Literal["DecodePool"] = "DecodePool"
    spec: DecodePoolSpec
    status: PoolStatus | None = None
