"""Rules across sections of one spec: env, NVLS and GPU-only settings against the vendor,
experts against EP.

A variable of another vendor's stack (RCCL_*, HSA_* on NVIDIA; NVLS on AMD) is ignored
silently by the engine and hides a wrong `accelerator`; expert parallelism on a model
that declares no experts splits nothing; GPU-only settings on `vendor: cpu` (a memory
fraction of a GPU, NCCL's InfiniBand and channel settings) configure nothing the engine
runs there. Each rule but the CPU ones is a CEL rule over a kind's spec and one
pydantic-side check (`check_sections`); the CPU ones are pydantic-only (the InferenceModel
CRD is at its size budget). A pool that inherits sections from its InferenceModel is
checked again once they are resolved.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.common import CommunicationSpec, EngineSpec, ModelSource, TopologySpec
from kvpilot.operator.api.rules import CelRule

AMD_ONLY_ENV = ("RCCL_", "HSA_", "HIP_", "ROCR_")
NVIDIA_ONLY_ENV = ("NCCL_NVLS_",)
AMD_ENV = ("RCCL_*, HSA_*, HIP_* and ROCR_* variables configure AMD's ROCm stack, which this "
           "accelerator.vendor does not run: remove them or set accelerator.vendor: amd")
NVLS = ("NVLS (communication.nvlsEnable, NCCL_NVLS_*) is NVLink SHARP, an NVIDIA fabric "
        "feature: remove it or set accelerator.vendor: nvidia")
CPU_GPU_ONLY = ("GPU-only settings (a GPU's memory fraction; NCCL's RDMA, InfiniBand and channel "
                "settings) configure nothing a CPU engine runs (it uses gloo): remove them or "
                "set accelerator.vendor to the GPUs'")
EXPERTS = ("topology.expertParallel > 1 splits a MoE model's experts: declare "
           "model.numExperts (a dense model has none) or set expertParallel to 1")


def _has(path: str) -> str:
    """Gives CEL that is true when every field along `path` (self.a.b) is set."""
    parts = path.split(".")
    return " && ".join(f"has({'.'.join(parts[:i])})" for i in range(2, len(parts) + 1))


def _any_env(paths: Iterable[str], prefixes: Sequence[str]) -> str:
    test = " || ".join(f"k.startsWith('{p}')" for p in prefixes)
    return " || ".join(f"({_has(p)} && {p}.exists(k, {test}))" for p in paths)


def vendor_rules(vendor: str, guard: str, env_paths: Sequence[str],
                 nvls_path: str) -> list[CelRule]:
    """Gives the env/NVLS-vs-vendor rules; `vendor` is the CEL path of accelerator.vendor and
    `guard` CEL that is true when the rules do not apply (the vendor is not known here)."""
    return [
        CelRule(f"{guard} || {vendor} == 'amd' || !({_any_env(env_paths, AMD_ONLY_ENV)})",
                AMD_ENV),
        CelRule(f"{guard} || {vendor} == 'nvidia' || !({_has(nvls_path)} || "
                f"{_any_env(env_paths, NVIDIA_ONLY_ENV)})", NVLS),
    ]


def check_sections(model: ModelSource | None, topologies: Iterable[TopologySpec | None],
                   accelerator: AcceleratorSpec | None, communication: CommunicationSpec | None,
                   envs: Iterable[Mapping[str, str]], engine: EngineSpec | None = None) -> None:
    """Raises ValueError naming the variable or field when sections contradict each other;
    unset sections (a pool's inherited ones) are checked once resolved."""
    names = [name for env in envs for name in env]
    if accelerator is not None and accelerator.vendor == "cpu":
        _check_cpu(engine, communication)
    if accelerator is not None:
        vendor = accelerator.vendor
        amd = [n for n in names if n.startswith(AMD_ONLY_ENV)]
        if vendor != "amd" and amd:
            raise ValueError(f"env {', '.join(amd)} with accelerator.vendor={vendor}: {AMD_ENV}")
        nvls = [n for n in names if n.startswith(NVIDIA_ONLY_ENV)]
        if communication is not None and communication.nvls_enable is not None:
            nvls.insert(0, "communication.nvlsEnable")
        if vendor != "nvidia" and nvls:
            raise ValueError(f"{', '.join(nvls)} with accelerator.vendor={vendor}: {NVLS}")
    if model is not None and model.num_experts is None:
        for topology in topologies:
            if topology is not None and topology.expert_parallel > 1:
                raise ValueError(f"topology.expertParallel={topology.expert_parallel} with "
                                 f"model.numExperts unset: {EXPERTS}")


def _check_cpu(engine: EngineSpec | None, communication: CommunicationSpec | None) -> None:
    """Raises ValueError naming the field when a GPU-only setting is set with vendor cpu."""
    gpu_only = []
    if engine is not None and engine.gpu_memory_utilization is not None:
        gpu_only.append(f"engine.gpuMemoryUtilization={engine.gpu_memory_utilization}")
    if communication is not None:
        for field, value in (("communication.rdma", communication.rdma or None),
                             ("communication.ibHca", communication.ib_hca),
                             ("communication.ibGidIndex", communication.ib_gid_index),
                             ("communication.minNchannels", communication.min_nchannels)):
            if value is not None:
                gpu_only.append(f"{field}={value}")
    if gpu_only:
        raise ValueError(f"{', '.join(gpu_only)} with accelerator.vendor=cpu: {CPU_GPU_ONLY}")
