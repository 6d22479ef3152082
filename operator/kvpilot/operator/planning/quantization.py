"""What 8-bit weights and an fp8 KV cache change in planning: where they run, and the
bytes a weight and a KV element take.

The engine keeps the LM head and embeddings in the model dtype, so an 8-bit model is
not one byte per parameter; without the model's shape the operator bounds their share
by EMBEDDING_SHARE (Llama-3-8B 13%, Llama-3.2-1B 21%, Qwen2-0.5B 28% of parameters),
which over-estimates the weights a little rather than admitting a model that cannot fit.
"""

from __future__ import annotations

from kvpilot.operator.api.accelerator import Vendor
from kvpilot.operator.api.common import EngineSpec
from kvpilot.operator.planning.accelerators import bytes_per_param

EMBEDDING_SHARE = 0.3
FP8_WEIGHTS = ("engine.quantization: fp8 runs on NVIDIA FP8 tensor cores (compute capability "
               "8.9+): set accelerator.vendor: nvidia or use quantization: int8")
FP8_KV = ("engine.kvCacheDtype: fp8 (E4M3) runs on NVIDIA GPUs of compute capability 8.9+ and "
          "on CPU: set kvCacheDtype: auto on this accelerator")


def check_quantization(engine: EngineSpec, vendor: Vendor) -> None:
    """Raises ValueError naming the field when `vendor` cannot run the engine's 8-bit formats."""
    if engine.quantization == "fp8" and vendor != "nvidia":
        raise ValueError(f"engine.quantization=fp8 with accelerator.vendor={vendor}: "
                         f"{FP8_WEIGHTS}")
    if engine.kv_cache_dtype == "fp8" and vendor == "amd":
        raise ValueError(f"engine.kvCacheDtype=fp8 with accelerator.vendor={vendor}: {FP8_KV}")


def weight_bytes(parameter_count: int, engine: EngineSpec, vendor: Vendor) -> int:
    """Gives the weights' bytes for `parameter_count` parameters in the engine's dtype and
    quantisation (an upper bound for 8-bit models)."""
    dtype_bytes = bytes_per_param(engine.dtype, vendor)
    if engine.quantization in (None, "none"):
        return parameter_count * dtype_bytes
    return int(parameter_count * (1 + EMBEDDING_SHARE * (dtype_bytes - 1)))


def kv_bytes_per_element(engine: EngineSpec, vendor: Vendor) -> int:
    """Gives the bytes of one cached K or V element: 1 for fp8, else the model dtype's."""
    return 1 if engine.kv_cache_dtype == "fp8" else bytes_per_param(engine.dtype, vendor)
