"""How a KV cache stores its rows: in the model dtype, or fp8 (E4M3) divided by a
per-layer scale and saturated to E4M3's range. Plain torch (no Triton): the torch
attention backend, the references of the kernels and the engine's block copies use it.

CPU torch cannot index float8 tensors (index_copy_, index_select, index_put), so rows
are moved through a uint8 view of the same bytes (`as_bytes`).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_KV_DTYPE).max)  # 448


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Gives `cache` viewed as uint8 when it is fp8 (indexable everywhere), else itself."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_DTYPE else cache


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gives `x` as a cache of `dtype` stores it: x / scale saturated to E4M3 for fp8,
    else a plain cast."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Gives cached rows `x` back in `dtype`: x * scale for fp8, else a plain cast."""
    if x.dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def cached_rows(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Gives float32 rows [n, kv_heads, d] of one of a layer's caches [blocks, block_size,
    kv_heads, d] at flat `slots`, dequantised."""
    flat = as_bytes(cache).reshape(-1, *cache.shape[2:])
    return from_cache_dtype(flat[slots].view(cache.dtype), torch.float32, scale)
