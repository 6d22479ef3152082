"""The InferenceModel kind: one served model, its pools, its router and its status."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.access import AuthSpec, NetworkPeer
from kvpilot.operator.api.adapters import (
    ADAPTER_RULES,
    ADAPTERS_LIST,
    MAX_ADAPTERS,
    AdapterSpec,
    check_adapters,
)
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
from kvpilot.operator.api.flow import (
    MAX_OBJECTIVES,
    OBJECTIVE_RULES,
    OBJECTIVES_LIST,
    FlowControlSpec,
    ObjectiveSpec,
    check_objectives,
)
from kvpilot.operator.api.gateway import InferencePoolSpec
from kvpilot.operator.api.names import MAX_REPLICAS
from kvpilot.operator.api.overrides import Overrides
from kvpilot.operator.api.rules import CelRule, validations
from kvpilot.operator.api.stored import ObservedStatus, StoredObject

ServingMode = Literal["aggregated", "disaggregated"]
RoutingPolicy = Literal["round-robin", "least-load", "prefix-aware", "predicted-latency"]
TemplateRole = Literal["prefill", "decode"]
"""Which of the InferenceModel's pool templates: spec.prefill or spec.decode."""


REPLICAS_IN_BOUNDS = ("replicas is the starting count of an autoscaled pool and must lie "
                     "within autoscaling.minReplicas..maxReplicas: move it between them")
TEMPLATE_RULES = [CelRule("!has(self.autoscaling) || (self.replicas >= "
                          "self.autoscaling.minReplicas && self.replicas <= "
                          "self.autoscaling.maxReplicas)", REPLICAS_IN_BOUNDS, ".replicas")]


class PoolTemplate(ApiModel):
    """What the InferenceModel asks of one of its pools (prefill or decode)."""

    model_config = ConfigDict(json_schema_extra=validations(TEMPLATE_RULES))

    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    """Replicas when autoscaling is off; the starting count when it is on."""
    autoscaling: AutoscalingSpec | None = None
    """Scale this pool on KV-cache pressure and queue depth."""
    topology: TopologySpec | None = None
    """Overrides spec.topology for this pool (e.g. a smaller TP for prefill)."""
    overrides: Overrides | None = None
    """Overrides spec.overrides for this pool's pods."""

    @model_validator(mode="after")
    def _replicas_in_bounds(self) -> PoolTemplate:
        bounds = self.autoscaling
        if bounds is not None and not bounds.min_replicas <= self.replicas <= bounds.max_replicas:
            raise ValueError(f"replicas={self.replicas} outside autoscaling.minReplicas="
                             f"{bounds.min_replicas}..maxReplicas={bounds.max_replicas}: "
                             f"{REPLICAS_IN_BOUNDS}")
        return self


class RouterSpec(ApiModel):
    """The router Deployment in front of the pools."""

    replicas: int = Field(default=1, ge=0, le=64)
    """Router replicas (stateless; 0 disables the router)."""
    policy: RoutingPolicy = "prefix-aware"
    """How the router picks an engine for each request."""
    flow_control: FlowControlSpec | None = None
    """Flow control in the router."""
    objectives: list[ObjectiveSpec] | None = Field(
        default=None, min_length=1, max_length=MAX_OBJECTIVES, json_schema_extra=OBJECTIVES_LIST)
    """Priority bands and latency objectives."""
    allow_from: list[NetworkPeer] | None = Field(default=None, max_length=32)
    """Who may connect to the router (NetworkPolicy peers); unset: anyone, as for a plain
    Service. The operator may always connect (it scrapes /metrics)."""


def _budget_rule(path: str) -> str:
    return (f"!has(self.gpuBudget) || !has({path}) || "
            f"{path}.tensorParallel * {path}.pipelineParallel <= self.gpuBudget")


def _pool_floor_gpus(pool: str) -> str:
    """Gives CEL for the GPUs a pool holds at its floor (minReplicas, else replicas)."""
    floor = (f"(has(self.{pool}.autoscaling) ? self.{pool}.autoscaling.minReplicas "
             f": self.{pool}.replicas)")
    gpus = (f"(has(self.{pool}.topology) ? self.{pool}.topology.tensorParallel * "
            f"self.{pool}.topology.pipelineParallel : "
            "self.topology.tensorParallel * self.topology.pipelineParallel)")
    return f"{floor} * {gpus}"


INFERENCE_MODEL_RULES = [
    CelRule("self.servingMode == 'aggregated' || has(self.prefill)",
            "servingMode disaggregated needs spec.prefill: add a prefill pool template",
            ".servingMode"),
    CelRule("self.servingMode == 'disaggregated' || !has(self.prefill)",
            "spec.prefill is only used when servingMode is disaggregated: remove it or switch mode",
            ".prefill"),
    CelRule("!has(self.accelerator.gpusPerNode) || "
            "self.topology.tensorParallel <= self.accelerator.gpusPerNode",
            TP_FITS_NODE, ".topology.tensorParallel"),
    CelRule(_budget_rule("self.topology"),
            "one replica needs tensorParallel*pipelineParallel GPUs, more than gpuBudget: "
            "raise gpuBudget or shrink the topology", ".gpuBudget"),
    CelRule(_budget_rule("self.decode.topology"),
            "decode.topology needs more GPUs per replica than gpuBudget: "
            "raise gpuBudget or shrink it",
            ".gpuBudget"),
    CelRule("!has(self.prefill) || " + _budget_rule("self.prefill.topology"),
            "prefill.topology needs more GPUs per replica than gpuBudget: "
            "raise gpuBudget or shrink it",
            ".gpuBudget"),
    CelRule("!has(self.inferencePool) || self.servingMode == 'aggregated'",
            "inferencePool selects engines that serve whole requests: with servingMode "
            "disaggregated a gateway's endpoint picker would skip kvpilot's prefill handoff; "
            "use aggregated, or send traffic to kvpilot's router", ".inferencePool"),
    CelRule(f"!has(self.gpuBudget) || {_pool_floor_gpus('decode')} + (has(self.prefill) ? "
            f"{_pool_floor_gpus('prefill')} : 0) <= self.gpuBudget",
            "the pools at their floor (autoscaling.minReplicas, else replicas) need more GPUs than "
            "gpuBudget: raise gpuBudget or lower the replicas", ".gpuBudget"),
    *vendor_rules("self.accelerator.vendor", "false", [
        "self.communication.env", "self.overrides.env", "self.decode.overrides.env",
        "self.prefill.overrides.env"], "self.communication.nvlsEnable"),
    CelRule("has(self.model.numExperts) || (self.topology.expertParallel == 1 && "
            "(!has(self.decode.topology) || self.decode.topology.expertParallel == 1) && "
            "(!has(self.prefill) || !has(self.prefill.topology) || "
            "self.prefill.topology.expertParallel == 1))", EXPERTS, ".model.numExperts"),
    *ADAPTER_RULES,
    *OBJECTIVE_RULES,
]


class InferenceModelSpec(ApiModel):
    """Desired state of a served model."""

    model_config = ConfigDict(json_schema_extra=validations(INFERENCE_MODEL_RULES))

    model: ModelSource
    """What to serve."""
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra={"default": {}})
    """Engine settings shared by all pools."""
    topology: TopologySpec = Field(default_factory=TopologySpec, json_schema_extra={"default": {}})
    """Parallelism of each replica (pools may override)."""
    accelerator: AcceleratorSpec = Field(default_factory=AcceleratorSpec,
                                         json_schema_extra={"default": {}})
    """Devices the replicas run on."""
    communication: CommunicationSpec = Field(default_factory=CommunicationSpec,
                                             json_schema_extra={"default": {}})
    """NCCL/RCCL settings."""
    serving_mode: ServingMode = "aggregated"
    """aggregated: one decode pool serves whole requests; disaggregated: prefill and decode pools."""
    prefill: PoolTemplate | None = None
    """Prefill pool (disaggregated only)."""
    decode: PoolTemplate = Field(default_factory=PoolTemplate, json_schema_extra={"default": {}})
    """Decode pool (in aggregated mode it serves both phases)."""
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra={"default": {}})
    """Router in front of the pools."""
    gpu_budget: int | None = Field(default=None, ge=1)
    """Most GPUs all pools of this model hold together; the autoscaler shares it between
    pools, and one replica of every pool must fit in it."""
    overrides: Overrides = Field(default_factory=Overrides, json_schema_extra={"default": {}})
    """Pod settings applied to every pool."""
    auth: AuthSpec = Field(default_factory=AuthSpec, json_schema_extra={"default": {}})
    """Client authentication of the OpenAI API (engines and router)."""
    progress_deadline_seconds: int | None = Field(default=None, ge=60)
    """Seconds a replica may stay not ready (downloading, loading, waiting for a node) before
    its pool reports ProgressDeadlineExceeded (default 3600)."""
    inference_pool: InferencePoolSpec | None = None
    """Also render a Gateway API InferencePool selecting the engines (aggregated mode only)."""
    adapters: list[AdapterSpec] | None = Field(
        default=None, min_length=1, max_length=MAX_ADAPTERS, json_schema_extra=ADAPTERS_LIST)
    """LoRA adapters served beside the model (aggregated only)."""

    @model_validator(mode="after")
    def _cross_field(self) -> InferenceModelSpec:
        rules = [r.message for r in INFERENCE_MODEL_RULES]
        if self.serving_mode == "disaggregated" and self.prefill is None:
            raise ValueError(f"servingMode=disaggregated without spec.prefill: {rules[0]}")
        if self.serving_mode == "aggregated" and self.prefill is not None:
            raise ValueError(f"servingMode=aggregated with spec.prefill set: {rules[1]}")
        if self.inference_pool is not None and self.serving_mode != "aggregated":
            raise ValueError(f"inferencePool with servingMode={self.serving_mode}: {rules[6]}")
        check_fits_node(self.topology, self.accelerator)
        for topo, message in ((self.topology, rules[3]),
                              (self.decode.topology, rules[4]),
                              (self.prefill.topology if self.prefill else None, rules[5])):
            if topo is None or self.gpu_budget is None:
                continue
            gpus = topo.tensor_parallel * topo.pipeline_parallel
            if gpus > self.gpu_budget:
                raise ValueError(f"{topo.tensor_parallel}*{topo.pipeline_parallel}={gpus} GPUs > "
                                 f"gpuBudget={self.gpu_budget}: {message}")
        if self.gpu_budget is not None:
            templates: list[tuple[TemplateRole, PoolTemplate | None]] = [
                ("decode", self.decode), ("prefill", self.prefill)]
            terms = [(t.autoscaling.min_replicas if t.autoscaling else t.replicas,
                      self.pool_topology(role)) for role, t in templates if t is not None]
            need = sum(n * topo.tensor_parallel * topo.pipeline_parallel for n, topo in terms)
            if need > self.gpu_budget:
                raise ValueError(f"{need} GPUs at the pools' floor > gpuBudget={self.gpu_budget}: "
                                 f"{rules[7]}")
        check_objectives(self.router.objectives or [], self.model.name, self.adapters or [])
        check_adapters(self.adapters or [], self.model.name, self.serving_mode,
                       self.engine.max_loras is not None or self.engine.max_lora_rank is not None)
        pools = [t for t in (self.decode, self.prefill) if t is not None]
        check_sections(self.model, [self.topology, *(t.topology for t in pools)],
                       self.accelerator, self.communication,
                       [self.communication.env, self.overrides.env,
                        *(t.overrides.env for t in pools if t.overrides)], self.engine)
        return self

    def pool_topology(self, role: TemplateRole) -> TopologySpec:
        """Gives the topology a pool runs with: its own override, else spec.topology."""
        template = self.prefill if role == "prefill" else self.decode
        return (template.topology if template and template.topology else None) or self.topology


class PoolReplicas(ApiModel):
    """Replica counts of one pool as the InferenceModel sees them."""

    desired: int = 0
    """Replicas asked for."""
    ready: int = 0
    """Replicas passing readiness."""


WeightsPhase = Literal["Pending", "Downloading", "Downloaded", "Cached", "Failed"]


class WeightsStatus(ApiModel):
    """Where an hf:// model's weights are, as far as the operator can see (Job and pod states,
    the download's progress line in the pod log)."""

    phase: WeightsPhase
    """Pending (the Job's pod has not started), Downloading, Cached (the claim is filled),
    Downloaded (every engine pod finished its own download) or Failed."""
    progress: int | None = Field(default=None, ge=0, le=100)
    """Percent of the bytes downloaded, from the downloader's last progress line."""
    message: str = ""
    """What is happening or went wrong, naming the pod or Job."""
    claim: str | None = None
    """PersistentVolumeClaim holding the cache (spec.model.cache)."""
    state: str = ""
    """phase and progress as text, e.g. Downloading 42% (printer column)."""


class InferenceModelStatus(ObservedStatus):
    """Observed state, written by the operator and the autoscaler."""

    prefill: PoolReplicas | None = None
    """Prefill pool replicas (disaggregated only)."""
    decode: PoolReplicas | None = None
    """Decode pool replicas."""
    prefill_replicas: str | None = None
    """Ready/desired prefill replicas as text, e.g. 1/2 (printer column)."""
    decode_replicas: str | None = None
    """Ready/desired decode replicas as text, e.g. 2/2 (printer column)."""
    endpoint: str | None = None
    """URL of the router's OpenAI API inside the cluster."""
    kv_cache_utilization: float | None = Field(default=None, ge=0, le=1)
    """Mean fraction of KV-cache blocks in use across decode replicas."""
    kv_cache_percent: int | None = Field(default=None, ge=0, le=100)
    """kvCacheUtilization as a whole percentage (printer column)."""
    queue_depth: int | None = Field(default=None, ge=0)
    """Waiting requests summed over all replicas."""
    last_scale_decision: ScaleDecision | None = None
    """The autoscaler's latest decision."""
    weights: WeightsStatus | None = None
    """Where the weights of an hf:// model are (absent for pvc://, oci:// and dummy: sources)."""


class InferenceModel(StoredObject):
    """An InferenceModel object as stored by the API server."""

    kind: Literal["InferenceModel"] = "InferenceModel"
    spec: InferenceModelSpec
    status: InferenceModelStatus | None = None
