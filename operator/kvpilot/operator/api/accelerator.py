"""The accelerator section: the devices a replica runs on, and the device facts its rules need.

The facts (which models exist, their memory, how AMD partitions split them) are data the
admission rules and the planner share, so an unknown model or a partition count a mode
cannot have is refused at `kubectl apply`, not discovered by a pod that never schedules.
Sources are listed in `kvpilot.operator.planning.accelerators`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.rules import CelRule, validations

Vendor = Literal["nvidia", "amd", "cpu"]
ComputePartition = Literal["SPX", "DPX", "QPX", "CPX"]
MemoryPartition = Literal["NPS1", "NPS4"]
ResourceNaming = Literal["single", "mixed"]

PHYSICAL_GPUS_PER_NODE = 8
CPU_NO_GPU = "a CPU replica runs on no GPU (vendor cpu: the engine runs on the node's CPUs);"
# Logical GPUs one physical AMD GPU becomes in each compute partition mode.
LOGICAL_PER_GPU = {"SPX": 1, "DPX": 2, "QPX": 4, "CPX": 8}
# (compute, memory) pairs AMD validates on MI300-series GPUs.
VALID_AMD_MODES = {("SPX", "NPS1"), ("DPX", "NPS1"), ("QPX", "NPS1"), ("CPX", "NPS1"),
                   ("CPX", "NPS4")}
# HBM per physical GPU in GB (vendor-rated, decimal).
AMD_MEMORY_GB = {"MI300X": 192, "MI325X": 256, "MI250X": 128, "MI210": 64}
# Models with compute/memory partitioning (CDNA 3).
AMD_PARTITIONABLE = ("MI300X", "MI325X")
# NVIDIA model -> (memory GB, GPU feature discovery product label values).
NVIDIA_MODELS: dict[str, tuple[int, tuple[str, ...]]] = {
    "H100-80GB": (80, ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe")),
    "H200": (141, ("NVIDIA-H200",)),
    "B200": (180, ("NVIDIA-B200",)),
    "A100-80GB": (80, ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe")),
    "A100-40GB": (40, ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB")),
    "L40S": (48, ("NVIDIA-L40S",)),
    "L4": (24, ("NVIDIA-L4",)),
}


def _cel_list(items: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


_LOGICAL = "{" + ", ".join(f"'{k}': {v}" for k, v in LOGICAL_PER_GPU.items()) + "}"

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
    CelRule(f"self.vendor != 'amd' || !has(self.model) || self.model in {_cel_list(AMD_MEMORY_GB)}",
            f"accelerator.model is not a known AMD model: use one of {', '.join(AMD_MEMORY_GB)}",
            ".model"),
    CelRule(f"self.vendor != 'nvidia' || !has(self.model) || "
            f"self.model in {_cel_list(NVIDIA_MODELS)}",
            f"accelerator.model is not a known NVIDIA model: use one of {', '.join(NVIDIA_MODELS)}",
            ".model"),
    CelRule(f"!has(self.computePartition) || !has(self.model) || "
            f"self.model in {_cel_list(AMD_PARTITIONABLE)}",
            f"this AMD model cannot be partitioned: remove computePartition/memoryPartition or "
            f"use one of {', '.join(AMD_PARTITIONABLE)}", ".computePartition"),
    CelRule(f"!has(self.computePartition) || !has(self.gpusPerNode) || "
            f"(self.gpusPerNode % {_LOGICAL}[self.computePartition] == 0 && self.gpusPerNode <= "
            f"{PHYSICAL_GPUS_PER_NODE} * {_LOGICAL}[self.computePartition])",
            f"gpusPerNode must be a whole number of partitioned GPUs: a multiple of the "
            f"partition's logical GPUs per physical GPU (SPX 1, DPX 2, QPX 4, CPX 8), at most "
            f"{PHYSICAL_GPUS_PER_NODE} physical GPUs' worth: fix gpusPerNode or unset it",
            ".gpusPerNode"),
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
        given = (f"vendor={self.vendor}, model={self.model}, gpusPerNode={self.gpus_per_node}, "
                 f"computePartition={self.compute_partition}, memoryPartition="
                 f"{self.memory_partition}, resourceNaming={self.resource_naming}")
        logical = LOGICAL_PER_GPU.get(self.compute_partition or "")
        per_node = self.gpus_per_node
        broken = [
            self.vendor != "amd" and self.compute_partition is not None,
            self.vendor != "amd" and self.memory_partition is not None,
            self.memory_partition == "NPS4" and self.compute_partition != "CPX",
            self.resource_naming == "mixed" and self.compute_partition is None,
            self.vendor == "amd" and self.model is not None and self.model not in AMD_MEMORY_GB,
            self.vendor == "nvidia" and self.model is not None
            and self.model not in NVIDIA_MODELS,
            self.compute_partition is not None and self.model is not None
            and self.model not in AMD_PARTITIONABLE,
            logical is not None and per_node is not None
            and (per_node % logical != 0 or per_node > PHYSICAL_GPUS_PER_NODE * logical),
        ]
        for rule, is_broken in zip(ACCELERATOR_RULES, broken, strict=True):
            if is_broken:
                raise ValueError(f"accelerator ({given}): {rule.message}")
        # operator-only: a CEL twin would not fit the InferenceModel CRD's size budget
        if self.vendor == "cpu" and self.model is not None:
            raise ValueError(f"accelerator.model={self.model} with accelerator.vendor=cpu: "
                             f"{CPU_NO_GPU} remove model, or set vendor to the GPU's")
        if self.vendor == "cpu" and self.gpus_per_node is not None:
            raise ValueError(f"accelerator.gpusPerNode={self.gpus_per_node} with "
                             f"accelerator.vendor=cpu: {CPU_NO_GPU} remove gpusPerNode")
        return self
