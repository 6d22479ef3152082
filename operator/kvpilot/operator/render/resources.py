"""Resources of engine pods: GPUs, CPU and memory requests, and memory limits from the model.

When the user sets no memory limit, an engine container gets

    limit = 4 GiB runtime + weights held by the pod + host KV cache (CPU only) + /dev/shm

- weights: `model.weightBytes`, else `parameterCount` x bytes per parameter of the dtype,
  divided over the nodes of a multi-node replica; 32 GiB when neither is given for a
  `hf://` or `pvc://` model (built-in models' weights are a few MiB). Loading reads them
  through host memory, and on CPU they stay there.
- host KV cache: `engine.kvCacheMemory` (engine default 256 MiB) on CPU, where it lives in
  host memory; GPU KV blocks live on the GPU.
- /dev/shm: a memory-backed emptyDir, charged to the pod's memory when NCCL fills it.
The limit is never below the memory request. A user limit (or request) always wins.
"""

from __future__ import annotations

import math
from typing import Any

from kvpilot.engine.contracts.args import parse_size
from kvpilot.operator.api.formats import parse_quantity
from kvpilot.operator.planning.pool import ResolvedPool
from kvpilot.operator.planning.quantization import weight_bytes as quantized_weight_bytes

# Resource the NVIDIA network operator's RDMA shared device plugin advertises by default.
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
RUNTIME_BYTES = 4 * 2**30
UNKNOWN_WEIGHT_BYTES = 32 * 2**30
CPU_KV_CACHE_DEFAULT = "256MiB"  # the engine's default budget on CPU
DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
# The weights download: a network-bound client, a little memory for its buffers.
FETCH_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


def weight_bytes(pool: ResolvedPool) -> int | None:
    """Gives the bytes of the model's weights, when the spec says or implies them."""
    model = pool.model
    if model.weight_bytes is not None:
        return model.weight_bytes
    if model.parameter_count is not None:
        return quantized_weight_bytes(model.parameter_count, pool.engine,
                                      pool.accelerator.vendor)
    return None


def gib(size: int) -> str:
    """Gives a quantity of whole GiB at least `size` bytes."""
    return f"{max(1, math.ceil(size / 2**30))}Gi"


def memory_limit_bytes(pool: ResolvedPool) -> int:
    """Gives the default memory limit of one engine container (the module's formula)."""
    weights = weight_bytes(pool)
    if weights is None:
        weights = 0 if pool.model.source.startswith("dummy:") else UNKNOWN_WEIGHT_BYTES
    kv = parse_size(pool.engine.kv_cache_memory or CPU_KV_CACHE_DEFAULT) \
        if pool.accelerator.vendor == "cpu" else 0
    shm = int(parse_quantity(pool.placement.shm_size))
    return RUNTIME_BYTES + math.ceil(weights / pool.placement.nodes_per_replica) + kv + shm


def engine_resources(pool: ResolvedPool) -> dict[str, Any]:
    """Gives the engine container's requests and limits."""
    extras, placement = pool.overrides.resources, pool.placement
    limits: dict[str, Any] = {k: str(v) for k, v in extras.limits.items()}
    # A limit without a request: Kubernetes makes the request equal to it, so no default
    # request may exceed it.
    requests: dict[str, Any] = {k: v for k, v in DEFAULT_REQUESTS.items() if k not in limits}
    requests.update({k: str(v) for k, v in extras.requests.items()})
    if "memory" not in limits:
        need = max(memory_limit_bytes(pool), int(parse_quantity(requests["memory"])))
        limits["memory"] = gib(need)
    devices: dict[str, Any] = {}
    if placement.gpu_resource:
        devices[placement.gpu_resource] = str(placement.gpus_per_pod)
    if placement.rdma:
        devices[RDMA_RESOURCE] = "1"
    # Extended resources cannot be overcommitted: requests must equal limits.
    requests.update(devices)
    limits.update(devices)
    return {"requests": requests, "limits": limits}
