"""A pool resolved once: every section filled from its InferenceModel, and its pods placed.

A stored PrefillPool/DecodePool spec leaves sections unset that its InferenceModel
supplies; `resolve_pool` fills them (own value, else the owner's, else the default)
and plans the placement, so errors a user can cause (a topology the model cannot
split, weights that do not fit) surface here, naming the field. Renderers, the
engine ConfigMap, `kvpilot up` and the autoscaler read the `ResolvedPool` it gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.access import AuthSpec, NetworkPeer
from kvpilot.operator.api.adapters import AdapterSpec, check_adapters
from kvpilot.operator.api.autoscaling import AutoscalingSpec
from kvpilot.operator.api.common import CommunicationSpec, EngineSpec, ModelSource, TopologySpec
from kvpilot.operator.api.consistency import check_sections
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.overrides import Overrides
from kvpilot.operator.api.pools import AnyPoolSpec
from kvpilot.operator.api.speculative import check_speculative_pool
from kvpilot.operator.planning.kv_cache import check_kv_cache
from kvpilot.operator.planning.placement import PodPlacement, plan_placement
from kvpilot.operator.planning.quantization import check_quantization

# A replica may take this long to become ready (download, load, a node) before its pool
# reports ProgressDeadlineExceeded; big models on a slow link need most of an hour.
PROGRESS_DEADLINE_SECONDS = 3600
PoolRole = Literal["prefill", "decode", "both"]
"""Engine role of a pool's replicas (`kvpilot serve --role`)."""
Section = TypeVar("Section")


@dataclass(frozen=True)
class ResolvedPool:
    """A pool spec with every section set and its placement planned."""

    role: PoolRole
    replicas: int
    model: ModelSource
    engine: EngineSpec
    topology: TopologySpec
    accelerator: AcceleratorSpec
    communication: CommunicationSpec
    overrides: Overrides
    placement: PodPlacement
    auth: AuthSpec = field(default_factory=AuthSpec)
    """Client authentication of the engines' API."""
    allow_from: tuple[NetworkPeer, ...] = ()
    """Who besides the model's router and the operator may reach the engines' HTTP port."""
    autoscaling: AutoscalingSpec | None = None
    """Absent: the pool keeps its replicas."""
    model_ref: str | None = None
    """The InferenceModel the sections came from (None: an inline model)."""
    progress_deadline_seconds: int = PROGRESS_DEADLINE_SECONDS
    """Seconds a replica may stay not ready before the pool reports ProgressDeadlineExceeded."""
    adapters: tuple[AdapterSpec, ...] = ()
    """LoRA adapters served beside the model (the InferenceModel's spec.adapters)."""

    def to_json(self) -> dict[str, Any]:
        """Gives the camelCase pool spec this resolves to (the pods' spec hash digests it)."""
        out: dict[str, Any] = {
            "model": self.model.to_json(), "engine": self.engine.to_json(),
            "replicas": self.replicas, "topology": self.topology.to_json(),
            "accelerator": self.accelerator.to_json(),
            "communication": self.communication.to_json(),
            "overrides": self.overrides.to_json(), "role": self.role,
        }
        if self.auth.api_key_secret_ref is not None:  # absent: the hash of older specs holds
            out["auth"] = self.auth.to_json()
        if self.model_ref is not None:
            out["modelRef"] = self.model_ref
        if self.autoscaling is not None:
            out["autoscaling"] = self.autoscaling.to_json()
        if self.progress_deadline_seconds != PROGRESS_DEADLINE_SECONDS:
            out["progressDeadlineSeconds"] = self.progress_deadline_seconds
        if self.adapters:  # absent: the hash of older specs holds
            out["adapters"] = [a.to_json() for a in self.adapters]
        return out


def _pick(own: Section | None, inherited: Section | None, default: Section) -> Section:
    if own is not None:
        return own
    return inherited if inherited is not None else default


def with_flow_order(engine: EngineSpec, owner: InferenceModelSpec | None) -> EngineSpec:
    """Gives `engine` with `--scheduling-policy priority` added to its extraArgs when the
    owner's router runs flow control (spec.router.flowControl) and they leave the policy
    unset: the router then sends each request's engine priority (its band, quiet flows
    first), which only that policy honours."""
    if owner is None or owner.router.flow_control is None or any(
            arg.split("=", 1)[0] == "--scheduling-policy" for arg in engine.extra_args):
        return engine
    return engine.model_copy(update={"extra_args": [*engine.extra_args,
                                                    "--scheduling-policy", "priority"]})


def resolve_pool(spec: AnyPoolSpec, owner: InferenceModelSpec | None) -> ResolvedPool:
    """Gives the pool with every section filled (own value, else `owner`'s, else the default)
    and its placement planned; raises ValueError naming the field when it cannot run: the
    sections contradict each other, the KV cache cannot hold one sequence, or its replicas
    need more GPUs than the InferenceModel's gpuBudget."""
    model = _pick(spec.model, owner.model if owner else None, None)
    if model is None:
        raise ValueError(f"spec.modelRef={spec.model_ref!r} names no InferenceModel in this "
                         "namespace: create it or set spec.model inline")
    template = "prefill" if spec.role == "prefill" else "decode"
    engine = with_flow_order(_pick(spec.engine, owner.engine if owner else None, EngineSpec()),
                             owner)
    topology = _pick(spec.topology, owner.pool_topology(template) if owner else None,
                     TopologySpec())
    accelerator = _pick(spec.accelerator, owner.accelerator if owner else None,
                        AcceleratorSpec())
    communication = _pick(spec.communication, owner.communication if owner else None,
                          CommunicationSpec())
    overrides = _pick(spec.overrides, owner.overrides if owner else None, Overrides())
    check_sections(model, [topology], accelerator, communication,
                   [communication.env, overrides.env], engine)
    adapters = tuple(owner.adapters or ()) if owner else ()
    check_adapters(adapters, model.name, "aggregated" if spec.role == "both" else "disaggregated",
                   engine.max_loras is not None or engine.max_lora_rank is not None)
    check_kv_cache(model, engine, accelerator.vendor)
    check_quantization(engine, accelerator.vendor)
    check_speculative_pool(engine.speculative,
                           topology.tensor_parallel * topology.pipeline_parallel, spec.role)
    placement = plan_placement(topology, model, accelerator, engine, communication)
    budget = owner.gpu_budget if owner else None
    gpus = spec.replicas * placement.gpus_per_pod * placement.nodes_per_replica
    if budget is not None and gpus > budget:
        raise ValueError(f"spec.replicas={spec.replicas} x {gpus // spec.replicas} GPUs per "
                         f"replica = {gpus} GPUs > the InferenceModel's gpuBudget={budget}: "
                         "lower replicas or raise gpuBudget")
    return ResolvedPool(
        role=spec.role, replicas=spec.replicas, model=model, engine=engine, topology=topology,
        accelerator=accelerator, communication=communication, overrides=overrides,
        placement=placement, autoscaling=spec.autoscaling, model_ref=spec.model_ref,
        auth=_pick(spec.auth, owner.auth if owner else None, AuthSpec()),
        allow_from=tuple(spec.allow_from or ()),
        progress_deadline_seconds=_pick(
            spec.progress_deadline_seconds, owner.progress_deadline_seconds if owner else None,
            PROGRESS_DEADLINE_SECONDS),
        adapters=adapters)
