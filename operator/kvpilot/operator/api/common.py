"""Types shared by the three kinds: model, engine, topology, accelerator, NCCL, scaling, overrides.

Python names are snake_case; the JSON the API server stores is camelCase (pydantic
aliases). Every cross-field rule lives twice on purpose: as a CEL rule in the
model's ``x-kubernetes-validations`` (so the API server rejects the object at
``kubectl apply``) and as a pydantic validator (so ``kvpilot up`` and the operator
reject it with the same message). A test checks that both agree on every fixture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator
from pydantic.alias_generators import to_camel

Vendor = Literal["nvidia", "amd", "cpu"]
ComputePartition = Literal["SPX", "DPX", "QPX", "CPX"]
MemoryPartition = Literal["NPS1", "NPS4"]
ResourceNaming = Literal["single", "mixed"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ConditionStatus = Literal["True", "False", "Unknown"]
NcclDebug = Literal["VERSION", "WARN", "INFO", "TRACE"]
JsonDict = dict[str, JsonValue]
"""A JSON object, as `json_schema_extra` takes it."""


@dataclass(frozen=True)
class CelRule:
    """One `x-kubernetes-validations` entry: a CEL rule, the message it fails with, its field."""

    rule: str
    message: str
    field_path: str | None = None

    def to_json(self) -> JsonDict:
        """Gives the entry as the CRD schema spells it."""
        entry: JsonDict = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def validations(rules: Sequence[CelRule]) -> JsonDict:
    """Gives the `json_schema_extra` that puts `rules` into a type's schema."""
    return {"x-kubernetes-validations": [rule.to_json() for rule in rules]}


class ApiModel(BaseModel):
    """Base of every API type: camelCase JSON, unknown fields rejected, docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_json(self) -> dict[str, Any]:
        """Gives the camelCase dict the API server stores (unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SecretRef(ApiModel):
    """A key of a Secret in the object's namespace."""

    name: str = Field(min_length=1)
    """Name of the Secret."""
    key: str = "HF_TOKEN"
    """Key inside the Secret whose value is exported as HF_TOKEN."""


QUANTITY = r"^\d+(\.\d+)?([KMGTPE]i|[kMGTPE])?$"
"""A Kubernetes resource quantity such as 40Gi or 500G."""


class WeightCacheSpec(ApiModel):
    """A PersistentVolumeClaim, filled once by a Job, that every engine pod mounts read-only."""

    size: str = Field(pattern=QUANTITY)
    """Capacity to request, e.g. 40Gi: the filtered files plus a few percent."""
    storage_class_name: str | None = Field(default=None, max_length=253)
    """StorageClass of the claim (default: the cluster's default class)."""
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce"] = "ReadWriteMany"
    """ReadWriteMany lets pods on every node mount it (the class must offer it: NFS, CephFS,
    EFS, Filestore, ...); ReadWriteOnce works only while the Job and every engine pod share
    one node."""


MODEL_SOURCE_RULES = [
    CelRule("!has(self.cache) || self.source.startsWith('hf://')",
            "cache holds a Hub download: use an hf:// source, or remove cache (pvc:// and "
            "oci:// weights are pre-staged already)", ".cache"),
    CelRule("(!has(self.include) && !has(self.exclude)) || self.source.startsWith('hf://')",
            "include and exclude filter a Hub download: remove them, or use an hf:// source",
            ".include"),
]


class ModelSource(ApiModel):
    """Which weights to serve, under which name, and the architecture facts planning needs."""

    model_config = ConfigDict(json_schema_extra=validations(MODEL_SOURCE_RULES))

    name: str = Field(min_length=1, max_length=253)
    """Model name clients send in the OpenAI `model` field."""
    source: str = Field(pattern=r"^(hf://[^/\s]+/[^\s]+|pvc://[^/\s]+(/[^\s]*)?|oci://[^\s]+|"
                                r"dummy:[a-z0-9-]+)$")
    """Where weights come from: hf://org/name (downloaded), pvc://claim/path (pre-staged on a
    claim), oci://registry/image:tag (an image volume holding the weights under /models, the
    KServe modelcar layout; Kubernetes 1.33+) or dummy:tiny-llama (random weights)."""
    revision: str | None = Field(default=None, max_length=255)
    """Hugging Face revision (branch, tag or commit) for hf:// sources; a commit pins the
    weights, a branch is resolved once per download (and once per cache)."""
    secret_ref: SecretRef | None = None
    """Secret holding a Hugging Face token for gated hf:// models."""
    include: list[str] | None = Field(default=None, min_length=1, max_length=64)
    """Globs of the files to download from hf:// (default: *.safetensors, *.json,
    tokenizer.model, chat_template.jinja)."""
    exclude: list[str] | None = Field(default=None, max_length=64)
    """Globs of files to leave out (default: original/*, consolidated*.safetensors)."""
    cache: WeightCacheSpec | None = None
    """Download hf:// weights once into a claim all replicas mount, instead of once per pod."""
    num_attention_heads: int | None = Field(default=None, ge=1)
    """Attention heads per layer; checked against tensorParallel."""
    num_key_value_heads: int | None = Field(default=None, ge=1)
    """KV heads per layer (GQA); replicated when tensorParallel exceeds them."""
    num_layers: int | None = Field(default=None, ge=1)
    """Transformer layers; pipelineParallel may not exceed them."""
    num_experts: int | None = Field(default=None, ge=1)
    """Routed experts per MoE layer; expertParallel must divide them."""
    parameter_count: int | None = Field(default=None, ge=1)
    """Total parameters; weight bytes are derived from it and the dtype when weightBytes is unset."""
    weight_bytes: int | None = Field(default=None, ge=1)
    """Size of the weights in bytes; checked against accelerator memory per GPU."""

    @model_validator(mode="after")
    def _hub_only_fields(self) -> ModelSource:
        hub = self.source.startswith("hf://")
        if self.cache is not None and not hub:
            raise ValueError(f"source={self.source!r} with cache set: "
                             f"{MODEL_SOURCE_RULES[0].message}")
        if (self.include is not None or self.exclude is not None) and not hub:
            raise ValueError(f"source={self.source!r} with include/exclude set: "
                             f"{MODEL_SOURCE_RULES[1].message}")
        return self


class EngineSpec(ApiModel):
    """Engine settings rendered into `kvpilot serve` flags (see kvpilot.engine.contracts.args)."""

    dtype: Dtype = "auto"
    """Weight and activation dtype; auto is bfloat16 on GPU, float32 on CPU."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt plus output in tokens (default: the model's)."""
    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV-cache block."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    max_num_seqs: int = Field(default=256, ge=1)
    """Most sequences batched in one engine step."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Token budget of one engine step (prefill chunks plus decodes)."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Fraction of GPU memory the engine may use (engine default 0.9)."""
    kv_cache_memory: str | None = Field(default=None, pattern=r"^\d+(\.\d+)?\s*([KMGT]i?B?|B)?$")
    """Bytes for the KV cache on CPU, e.g. 512MiB."""
    extra_args: list[str] = Field(default_factory=list, max_length=64)
    """Further `kvpilot serve` flags appended verbatim, e.g. ["--seed", "1"]."""


class TopologySpec(ApiModel):
    """How one replica is split across GPUs."""

    tensor_parallel: int = Field(default=1, ge=1, le=64)
    """GPUs each layer is split across; stays within one node."""
    pipeline_parallel: int = Field(default=1, ge=1, le=64)
    """Pipeline stages; stages may sit on different nodes."""
    expert_parallel: int = Field(default=1, ge=1, le=64)
    """Ways each MoE layer's experts are split: 1 or tensorParallel; must divide the experts."""


ACCELERATOR_RULES = [
    CelRule("self.vendor == 'amd' || !has(self.computePartition)",
            "computePartition is an AMD setting: set vendor: amd or remove computePartition",
            ".computePartition"),
    CelRule("self.vendor == 'amd' || !has(self.memoryPartition)",
            "memoryPartition is an AMD setting: set vendor: amd or remove memoryPartition",
            ".memoryPartition"),
    CelRule("!has(self.memoryPartition) || self.memoryPartition != 'NPS4' || "
            "(has(self.computePartition) && self.computePartition == 'CPX')",
            "memoryPartition NPS4 needs computePartition CPX (SPX/DPX/QPX run with NPS1 only)",
            ".memoryPartition"),
    CelRule("self.resourceNaming == 'single' || has(self.computePartition)",
            "resourceNaming mixed names resources after the partition (e.g. amd.com/cpx_nps4): "
            "set computePartition or use resourceNaming single", ".resourceNaming"),
]


class AcceleratorSpec(ApiModel):
    """The devices a replica runs on and how the cluster names them."""

    model_config = ConfigDict(json_schema_extra=validations(ACCELERATOR_RULES))

    vendor: Vendor = "nvidia"
    """nvidia, amd, or cpu (no accelerator: the engine runs on CPU)."""
    model: str | None = Field(default=None, max_length=63)
    """Accelerator model, e.g. H100-80GB, H200, A100-80GB, L40S, MI300X, MI325X; selects nodes and sets memory per GPU."""
    gpus_per_node: int | None = Field(default=None, ge=1, le=128)
    """Logical GPUs each node offers (default: from the model and partition, else 8)."""
    compute_partition: ComputePartition | None = None
    """AMD compute partition of each physical GPU (SPX 1, DPX 2, QPX 4, CPX 8 logical GPUs)."""
    memory_partition: MemoryPartition | None = None
    """AMD memory partition (NPS1, or NPS4 with CPX)."""
    resource_naming: ResourceNaming = "single"
    """AMD device plugin naming: single (amd.com/gpu) or mixed (amd.com/<compute>_<memory>)."""

    @model_validator(mode="after")
    def _partition_rules(self) -> AcceleratorSpec:
        given = (f"vendor={self.vendor}, computePartition={self.compute_partition}, "
                 f"memoryPartition={self.memory_partition}, resourceNaming={self.resource_naming}")
        broken = [
            self.vendor != "amd" and self.compute_partition is not None,
            self.vendor != "amd" and self.memory_partition is not None,
            self.memory_partition == "NPS4" and self.compute_partition != "CPX",
            self.resource_naming == "mixed" and self.compute_partition is None,
        ]
        for rule, is_broken in zip(ACCELERATOR_RULES, broken, strict=True):
            if is_broken:
                raise ValueError(f"accelerator ({given}): {rule.message}")
        return self


TP_FITS_NODE = ("topology.tensorParallel must fit one node: lower it to accelerator.gpusPerNode "
                "or below")


def check_fits_node(topology: TopologySpec | None, accelerator: AcceleratorSpec | None) -> None:
    """Raises ValueError (TP_FITS_NODE) when tensorParallel exceeds accelerator.gpusPerNode.

    The CEL twin of this check sits in each kind's rules (InferenceModel, pools).
    """
    per_node = accelerator.gpus_per_node if accelerator is not None else None
    if topology is not None and per_node is not None and topology.tensor_parallel > per_node:
        raise ValueError(f"topology.tensorParallel={topology.tensor_parallel} > "
                         f"accelerator.gpusPerNode={per_node}: {TP_FITS_NODE}")


class CommunicationSpec(ApiModel):
    """NCCL/RCCL settings; each typed field becomes one environment variable, env wins over all."""

    socket_ifname: str | None = Field(default=None, max_length=128)
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, e.g. eth0 or ^lo,docker."""
    ib_hca: str | None = Field(default=None, max_length=256)
    """NCCL_IB_HCA, e.g. mlx5_0,mlx5_1 (with rdma: true)."""
    ib_gid_index: int | None = Field(default=None, ge=0, le=255)
    """NCCL_IB_GID_INDEX; RoCE v2 fabrics usually need 3."""
    debug: NcclDebug | None = None
    """NCCL_DEBUG level."""
    min_nchannels: int | None = Field(default=None, ge=1, le=256)
    """NCCL_MIN_NCHANNELS (default 112 on MI300X when a replica spans GPUs)."""
    nvls_enable: bool | None = None
    """NCCL_NVLS_ENABLE: NVLink SHARP multicast (unset: NCCL decides)."""
    rdma: bool = False
    """Use InfiniBand/RoCE between nodes: adds IPC_LOCK and keeps NCCL's IB transport on."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables; they override everything derived above."""


class ResourceExtras(ApiModel):
    """Resources added to the engine container on top of the GPUs the topology needs."""

    requests: dict[str, str | int] = Field(default_factory=dict)
    """Extra requests, e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, str | int] = Field(default_factory=dict)
    """Extra limits, e.g. {memory: 128Gi}."""


class Overrides(ApiModel):
    """The curated part of the pod users may change; no full PodSpec on purpose (small CRDs)."""

    image: str | None = Field(default=None, max_length=512)
    """Engine image (default: the operator's --engine-image)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    """Pull policy of the engine image."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of Secrets for pulling the image."""
    resources: ResourceExtras = Field(default_factory=ResourceExtras,
                                      json_schema_extra={"default": {}})
    """Extra CPU, memory or other resources."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels nodes must carry, merged with the accelerator's own."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Pod tolerations (Kubernetes Toleration objects), added to the accelerator's."""
    affinity: dict[str, Any] | None = None
    """Pod affinity (a Kubernetes Affinity object), used as given."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables of the engine container."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra pod annotations."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra pod labels."""
    service_account_name: str | None = None
    """Service account of the engine pods."""


# Conditions merge by type under server-side apply (the Kubernetes convention).
CONDITIONS_LIST: JsonDict = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class Condition(ApiModel):
    """One observation of the object's state (the Kubernetes condition convention)."""

    type: str
    """Ready, Progressing or Degraded."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = ""
    """CamelCase cause, e.g. TopologyInvalid."""
    message: str = ""
    """What happened, naming the field and the fix."""
    last_transition_time: str | None = None
    """RFC 3339 time the status last changed."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed from."""


class ScaleDecision(ApiModel):
    """The autoscaler's latest change (or hold) of a pool."""

    time: str
    """RFC 3339 time of the decision."""
    pool: str = ""
    """Pool the decision is about (prefill or decode, or the pool's name)."""
    from_replicas: int = Field(ge=0)
    """Replicas before."""
    to_replicas: int = Field(ge=0)
    """Replicas after."""
    reason: str = ""
    """Which signal drove it, e.g. kvCacheUtilization 0.93 > 0.80."""
