"""Types shared by the three kinds: model, engine, topology, NCCL, conditions, scale decisions.

Python names are snake_case; the JSON the API server stores is camelCase (pydantic
aliases). Every cross-field rule lives twice on purpose: as a CEL rule in the
model's ``x-kubernetes-validations`` (so the API server rejects the object at
``kubectl apply``) and as a pydantic validator (so ``kvpilot up`` and the operator
reject it with the same message). A test checks that both agree on every fixture.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS
from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.adapters import MAX_ADAPTERS
from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.formats import QUANTITY, DnsSubdomain, EnvMap, SecretKey
from kvpilot.operator.api.rules import CelRule, JsonDict, validations
from kvpilot.operator.api.speculative import SpeculativeSpec

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "int8", "fp8"]  # the engine's QUANTIZATIONS
KvCacheDtype = Literal["auto", "fp8"]  # the engine's KV_CACHE_DTYPES
ConditionStatus = Literal["True", "False", "Unknown"]
NcclDebug = Literal["VERSION", "WARN", "INFO", "TRACE"]


# `dummy:` serves one of the engine's built-in configs with random weights and no files.
SOURCE_PATTERN = (r"^(hf://[^/\s]+/[^\s]+|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^\s]*)?|"
                  rf"oci://[^\s]+|dummy:({'|'.join(BUILTIN_CONFIGS)}))$")


class SecretRef(ApiModel):
    """A key of a Secret in the object's namespace."""

    name: DnsSubdomain
    """Name of the Secret."""
    key: SecretKey = "HF_TOKEN"
    """Key inside the Secret whose value is exported as HF_TOKEN."""


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
    source: str = Field(pattern=SOURCE_PATTERN)
    """Where weights come from: hf://org/name (downloaded), pvc://claim/path (pre-staged on a
    claim), oci://registry/image:tag (an image volume holding the weights under /models, the
    KServe modelcar layout; Kubernetes 1.33+) or dummy:<built-in> (random weights of
    tiny-llama, tiny-qwen3 or tiny-mixtral)."""
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
    """Routed experts per MoE layer (unset: a dense model); expertParallel must divide them."""
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


KV_CACHE_NOT_ZERO = ("kvCacheMemory must hold at least one KV block: a zero cache serves no "
                     "request; set e.g. 512MiB or unset it")
ENGINE_RULES = [CelRule("!has(self.kvCacheMemory) || "
                        "!self.kvCacheMemory.matches('^0+([.]0+)?[^1-9]*$')",
                        KV_CACHE_NOT_ZERO, ".kvCacheMemory")]


class EngineSpec(ApiModel):
    """Engine settings rendered into `kvpilot serve` flags (see kvpilot.engine.contracts.args)."""

    model_config = ConfigDict(json_schema_extra=validations(ENGINE_RULES))

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
    # unset rather than defaulted: a stored spec's hash, and so its pods, stay as they were
    quantization: Quantization | None = None
    """8-bit projection weights (--quantization; unset: none): int8 weight-only, or fp8 (W8A8,
    NVIDIA GPUs of compute capability 8.9+); the LM head and embeddings stay unquantised."""
    kv_cache_dtype: KvCacheDtype | None = None
    """KV-cache dtype (--kv-cache-dtype; unset: auto, the model dtype): fp8 (E4M3) holds twice
    the bf16 tokens per byte; NVIDIA GPUs of compute capability 8.9+, or CPU."""
    # speculative decoding (issue 23)
    speculative: SpeculativeSpec | None = None
    """Speculative decoding (n-gram or a draft model); one GPU per replica, aggregated only."""
    # LoRA adapters (issue 24): vLLM's --max-loras and --max-lora-rank; need spec.adapters
    max_loras: int | None = Field(default=None, ge=1, le=MAX_ADAPTERS)
    """--max-loras (unset: min(adapters, 4))."""
    max_lora_rank: int | None = Field(default=None, ge=1, le=512)
    """--max-lora-rank (unset: 16)."""
    extra_args: list[str] = Field(default_factory=list, max_length=64)
    """Further `kvpilot serve` flags, e.g. ["--seed", "1"]; the operator parses them with the
    engine's own parser and refuses unknown flags and flags it sets itself."""

    @model_validator(mode="after")
    def _cache_not_zero(self) -> EngineSpec:
        if self.kv_cache_memory is not None and re.search(r"^0+([.]0+)?[^1-9]*$",
                                                          self.kv_cache_memory):
            raise ValueError(f"engine.kvCacheMemory={self.kv_cache_memory!r}: {KV_CACHE_NOT_ZERO}")
        return self


class TopologySpec(ApiModel):
    """How one replica is split across GPUs."""

    tensor_parallel: int = Field(default=1, ge=1, le=64)
    """GPUs each layer is split across; stays within one node."""
    pipeline_parallel: int = Field(default=1, ge=1, le=64)
    """Pipeline stages; stages may sit on different nodes."""
    expert_parallel: int = Field(default=1, ge=1, le=64)
    """Ways each MoE layer's experts are split: 1 or tensorParallel; must divide the experts."""


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
    env: EnvMap = Field(default_factory=dict)
    """Extra environment variables; they override everything derived above."""


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
