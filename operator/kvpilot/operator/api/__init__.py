"""The kvpilot.dev/v1alpha1 API: pydantic models, the single source of the CRDs."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.access import AuthSpec, NetworkPeer, SecretKeyRef
from kvpilot.operator.api.autoscaling import AutoscalingSpec, AutoscalingTargets, ScalingRules
from kvpilot.operator.api.common import (
    CommunicationSpec,
    Condition,
    EngineSpec,
    ModelSource,
    ScaleDecision,
    SecretRef,
    TopologySpec,
    WeightCacheSpec,
)
from kvpilot.operator.api.inference_model import (
    InferenceModel,
    InferenceModelSpec,
    InferenceModelStatus,
    PoolReplicas,
    PoolTemplate,
    RouterSpec,
    WeightsStatus,
)
from kvpilot.operator.api.overrides import Overrides, ResourceExtras
from kvpilot.operator.api.pools import (
    DecodePool,
    DecodePoolSpec,
    PoolSpec,
    PoolStatus,
    PrefillPool,
    PrefillPoolSpec,
)
from kvpilot.operator.api.schema import Column, Kind, crd

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

_KV = Column("KV%", ".status.kvCachePercent", "integer", "KV-cache blocks in use, percent")
_QUEUE = Column("QUEUE", ".status.queueDepth", "integer", "waiting requests")
_AGE = Column("AGE", ".metadata.creationTimestamp", "date")
_REASON = Column("REASON", '.status.conditions[?(@.type=="Ready")].reason', "string",
                 "why Ready is what it is, e.g. Unschedulable, CrashLoop, AllReplicasReady")


def _pool_columns() -> list[Column]:
    return [
        Column("REPLICAS", ".spec.replicas", "integer", "desired replicas"),
        Column("READY", ".status.readyReplicas", "integer", "ready replicas"),
        _REASON, _KV, _QUEUE, _AGE,
        Column("MODEL", ".spec.modelRef", "string", "InferenceModel served", priority=1),
        Column("ROLE", ".spec.role", "string", "engine role", priority=1),
    ]


KINDS: list[Kind] = [
    Kind(
        kind="InferenceModel", plural="inferencemodels",
        description="A served model: engine settings, topology, accelerator, pools, router, "
                    "and their status.",
        spec=InferenceModelSpec,
        status=InferenceModelStatus, short_names=["im"],
        columns=[
            Column("READY", '.status.conditions[?(@.type=="Ready")].status', "string",
                   "Ready condition"),
            _REASON,
            Column("MODE", ".spec.servingMode", "string", "aggregated or disaggregated"),
            Column("TP", ".spec.topology.tensorParallel", "integer", "tensor parallel"),
            Column("PP", ".spec.topology.pipelineParallel", "integer", "pipeline parallel"),
            Column("EP", ".spec.topology.expertParallel", "integer", "expert parallel"),
            Column("PREFILL", ".status.prefillReplicas", "string", "ready/desired prefill"),
            Column("DECODE", ".status.decodeReplicas", "string", "ready/desired decode"),
            Column("WEIGHTS", ".status.weights.state", "string",
                   "where hf:// weights are: Downloading n%, Cached, Downloaded, Failed"),
            _KV, _QUEUE, _AGE,
            Column("ADAPTERS", ".spec.adapters[*].name", priority=1),
        ],
    ),
    Kind(kind="PrefillPool", plural="prefillpools", spec=PrefillPoolSpec, status=PoolStatus,
         description="Engine replicas that compute prompt KV and hand it to a decode pool.",
         short_names=["pfp"], columns=_pool_columns(), scale=True),
    Kind(kind="DecodePool", plural="decodepools", spec=DecodePoolSpec, status=PoolStatus,
         description="Engine replicas that decode, or serve whole requests with role both.",
         short_names=["dcp"], columns=_pool_columns(), scale=True),
]


def crd_manifests() -> list[dict[str, Any]]:
    """Gives the three CustomResourceDefinitions, InferenceModel first."""
    return [crd(kind, GROUP, VERSION) for kind in KINDS]


__all__ = [
    "API_VERSION", "GROUP", "KINDS", "VERSION", "AcceleratorSpec", "AuthSpec", "AutoscalingSpec",
    "AutoscalingTargets", "CommunicationSpec", "Condition", "DecodePool", "DecodePoolSpec",
    "EngineSpec", "InferenceModel", "InferenceModelSpec", "InferenceModelStatus", "ModelSource",
    "NetworkPeer", "Overrides", "PoolReplicas", "PoolSpec", "PoolStatus", "PoolTemplate",
    "PrefillPool", "PrefillPoolSpec", "ResourceExtras", "RouterSpec", "ScaleDecision",
    "ScalingRules", "SecretKeyRef", "SecretRef", "TopologySpec", "WeightCacheSpec",
    "WeightsStatus", "crd_manifests",
]
