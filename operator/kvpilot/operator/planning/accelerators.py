"""Accelerator facts: logical GPUs per node, memory per GPU, resource names, node labels, fit checks.

Pure data and arithmetic; no Kubernetes calls. Sources:
- AMD Instinct partitioning docs (instinct.docs.amd.com, "GPU partitioning"): an MI300X
  has 8 XCDs and 192 GB HBM; SPX/DPX/QPX/CPX expose 1/2/4/8 logical GPUs per physical
  GPU; NPS4 splits memory into four NUMA regions and AMD's guides configure it with
  CPX; no AMD page we found pairs it with QPX, so SPX, DPX and QPX run with NPS1.
- AMD GPU operator / device plugin: `resource_naming_strategy` single exposes
  `amd.com/gpu`; mixed exposes one resource per partition profile such as
  `amd.com/cpx_nps4`; GPUs that cannot partition (MI210, MI250X) stay `amd.com/gpu`. The
  node labeller's `compute-memory-partition` flag writes the active profile to
  `amd.com/compute-memory-partition` (e.g. cpx_nps4); the `amd.com/gpu.`-prefixed variant
  of that key is accepted as well.
- NVIDIA GPU operator: `nvidia.com/gpu` resource, GPU feature discovery's
  `nvidia.com/gpu.product` label (e.g. NVIDIA-H100-80GB-HBM3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.operator.api.accelerator import (
    AMD_MEMORY_GB,
    AMD_PARTITIONABLE,
    LOGICAL_PER_GPU,
    NVIDIA_MODELS,
    PHYSICAL_GPUS_PER_NODE,
    VALID_AMD_MODES,
    AcceleratorSpec,
)

GIB = 2**30
GB = 10**9

AMD_PARTITION_LABELS = ("amd.com/compute-memory-partition", "amd.com/gpu.compute-memory-partition")
NVIDIA_PRODUCT_LABEL = "nvidia.com/gpu.product"


class AcceleratorError(ValueError):
    """A spec the cluster's accelerators cannot satisfy; the message names the field and fix."""


@dataclass(frozen=True)
class Placement:
    """How pods of one replica ask for devices and where they may land."""

    vendor: str
    resource_name: str | None
    """Extended resource each GPU is requested as (None on CPU)."""
    gpus_per_node: int
    """Logical GPUs one node offers."""
    memory_bytes_per_gpu: int | None
    """Memory of one logical GPU, when the model is known."""
    node_selector_terms: list[list[dict[str, object]]] = field(default_factory=list)
    """Required node affinity: a node must match all expressions of any one term."""
    tolerations: list[dict[str, str]] = field(default_factory=list)
    """Tolerations for the vendor's GPU taint."""
    label_value: str | None = None
    """AMD partition label value, e.g. cpx_nps4."""


@dataclass(frozen=True)
class AmdMode:
    """One compute x memory partition mode of an AMD model."""

    compute: str
    memory: str
    gpus_per_node: int
    memory_gb_per_gpu: float

    @property
    def label_value(self) -> str:
        """Gives the node labeller's value, e.g. cpx_nps4."""
        return f"{self.compute.lower()}_{self.memory.lower()}"

    @property
    def mixed_resource(self) -> str:
        """Gives the mixed-strategy resource name, e.g. amd.com/cpx_nps4."""
        return f"amd.com/{self.label_value}"


def amd_mode(model: str, compute: str, memory: str) -> AmdMode:
    """Gives the partition mode of an AMD model; raises AcceleratorError for invalid pairs."""
    if (compute, memory) not in VALID_AMD_MODES:
        valid = ", ".join(f"{c}+{m}" for c, m in sorted(VALID_AMD_MODES))
        raise AcceleratorError(
            f"accelerator.computePartition={compute} with memoryPartition={memory} is not a "
            f"valid AMD mode: choose one of {valid}")
    if model not in AMD_PARTITIONABLE:
        raise AcceleratorError(f"accelerator.model={model!r} cannot be partitioned: remove "
                               f"computePartition/memoryPartition or use one of "
                               f"{', '.join(AMD_PARTITIONABLE)}")
    logical = LOGICAL_PER_GPU[compute]
    return AmdMode(compute, memory, PHYSICAL_GPUS_PER_NODE * logical,
                   AMD_MEMORY_GB[model] / logical)


def placement(acc: AcceleratorSpec) -> Placement:
    """Gives the resource name, node constraints and per-GPU memory for an accelerator spec."""
    if acc.vendor == "cpu":
        return Placement("cpu", None, acc.gpus_per_node or 1, None)
    if acc.vendor == "nvidia":
        return _nvidia(acc)
    return _amd(acc)


def _nvidia(acc: AcceleratorSpec) -> Placement:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    memory, terms = None, []
    if acc.model is not None:  # AcceleratorSpec admits known models only
        gb, products = NVIDIA_MODELS[acc.model]
        memory = gb * GB
        terms = [[{"key": NVIDIA_PRODUCT_LABEL, "operator": "In", "values": list(products)}]]
    return Placement("nvidia", "nvidia.com/gpu", acc.gpus_per_node or PHYSICAL_GPUS_PER_NODE,
                     memory, terms, [toleration])


def _amd(acc: AcceleratorSpec) -> Placement:
    toleration = {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    model = acc.model or "MI300X"
    if acc.compute_partition is None:
        memory = AMD_MEMORY_GB[model] * GB if model in AMD_MEMORY_GB else None
        return Placement("amd", "amd.com/gpu", acc.gpus_per_node or PHYSICAL_GPUS_PER_NODE,
                         memory, [], [toleration])
    mode = amd_mode(model, acc.compute_partition, acc.memory_partition or "NPS1")
    resource = mode.mixed_resource if acc.resource_naming == "mixed" else "amd.com/gpu"
    # Either label key selects the node: the two labeller generations write different keys.
    terms = [[{"key": key, "operator": "In", "values": [mode.label_value]}]
             for key in AMD_PARTITION_LABELS]
    return Placement("amd", resource, acc.gpus_per_node or mode.gpus_per_node,
                     int(mode.memory_gb_per_gpu * GB), terms, [toleration], mode.label_value)


def bytes_per_param(dtype: str, vendor: str) -> int:
    """Gives bytes per weight for an engine dtype (auto: bfloat16 on GPU, float32 on CPU)."""
    if dtype == "auto":
        return 4 if vendor == "cpu" else 2
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def check_memory_fit(weight_bytes: int, gpus: int, memory_bytes_per_gpu: int, *,
                     utilization: float = EngineArgs.gpu_memory_utilization,
                     kv_headroom: float = 0.1, where: str = "this accelerator") -> None:
    """Raises AcceleratorError unless each GPU's weight share leaves `kv_headroom` for KV cache.

    Each of `gpus` GPUs holds weight_bytes / gpus; the engine may use
    utilization x memory, of which kv_headroom stays free for the KV cache.
    """
    share = weight_bytes / gpus
    allowed = memory_bytes_per_gpu * utilization * (1 - kv_headroom)
    if share <= allowed:
        return
    needed = math.ceil(weight_bytes / allowed)
    raise AcceleratorError(
        f"model weights {weight_bytes / GB:.1f} GB / {gpus} GPU(s) = {share / GB:.1f} GB per GPU "
        f"exceed {memory_bytes_per_gpu / GB:.1f} GB x {utilization:.2f} utilization x "
        f"{1 - kv_headroom:.2f} (KV-cache headroom) = {allowed / GB:.1f} GB on {where}: raise "
        f"topology.tensorParallel x pipelineParallel to at least {needed} GPUs or pick an "
        "accelerator with more memory per GPU")
