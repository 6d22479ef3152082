"""KV-cache write: scatter a step's new K/V rows into the paged cache through a slot mapping.

``slot_mapping[t] = block * block_size + offset`` names where token ``t``'s K
and V go in a cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
``-1`` means "do not write" (padding rows, or tokens whose KV is already
cached). One program copies one token's K and V rows (all KV heads). An fp8
(E4M3) cache stores K / k_scale and V / v_scale, saturated to E4M3's +-448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE, as_bytes, to_cache_dtype
from kvpilot.kernels.pdl import pdl_args, wait_for_previous

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # E4M3's largest finite value


@jit
def cache_value(x, scale, KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """Gives rows `x` (the model's dtype) as a cache of `dtype` stores them: x / scale
    saturated to E4M3 for fp8, else a plain cast."""
    if KV_FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
    return x.to(dtype)


@jit
def _kv_cache_write_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_vt, stride_kv, stride_slot, k_scale, v_scale,
    ROW: tl.constexpr, BLOCK: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
    dst = cache_ptr + slot * stride_slot + offs
    cache_dtype: tl.constexpr = cache_ptr.dtype.element_ty
    tl.store(dst, cache_value(k, k_scale, KV_FP8, cache_dtype), mask=mask)
    tl.store(dst + stride_kv, cache_value(v, v_scale, KV_FP8, cache_dtype), mask=mask)


def kv_cache_write(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    kv_scales: tuple[float, float] = (1.0, 1.0),  # (k, v) dequantisation scales of an fp8 cache
) -> None:
    """Writes each token's K/V into its slot of the cache in place; gives nothing back."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    # a token's KV heads must be one dense row so that one program copies them at once
    assert k.stride(1) == k.shape[2] and k.stride(2) == 1, "k rows must be dense"
    assert v.stride(1) == v.shape[2] and v.stride(2) == 1, "v rows must be dense"
    row = k.shape[1] * k.shape[2]
    _kv_cache_write_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), v.stride(0), kv_cache.stride(0), kv_cache.stride(2), *kv_scales,
        ROW=row, BLOCK=triton.next_power_of_2(row), KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
        num_warps=4, **pdl_args(k),
    )


def kv_cache_write_ref(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Does the same write with torch indexing (in place; on the bytes, which CPU torch
    can index for fp8 too)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    for i, (x, x_scale) in enumerate(((k, kv_scales[0]), (v, kv_scales[1]))):
        rows = to_cache_dtype(x[keep], kv_cache.dtype, x_scale)
        as_bytes(kv_cache[i]).view(-1, num_kv_heads, head_dim)[slots] = as_bytes(rows)

