"""Rotary position embedding applied in place to q and k, neox or gpt-j pairing.

``cos_sin_cache[pos]`` holds ``rotary_dim / 2`` cosines then as many sines.
Neox style rotates the pairs ``(i, i + rotary_dim/2)``; gpt-j style rotates
adjacent pairs ``(2i, 2i + 1)``. Dimensions past ``rotary_dim`` (partial
rotary) are left as they are. One program handles every head of one token, so
each token's cos/sin row is read once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous


@jit
def rotate_pair(x1, x2, cos, sin):
    """Gives (x1 cos - x2 sin, x2 cos + x1 sin) in float32 with the multiply-adds spelled
    out: left to itself the compiler fuses one product of each into an FMA, and which one
    depends on the code around it, so another kernel (the fused q/k norm + rotary) could
    not reproduce these bits."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@jit
def pair_columns(offs_i, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Gives the columns (first, second) of rotated pairs `offs_i`: (i, i + HALF) neox style,
    (2i, 2i + 1) gpt-j style."""
    if IS_NEOX:
        return offs_i, offs_i + HALF
    return 2 * offs_i, 2 * offs_i + 1


@jit
def _rotate(base, stride_h, n_heads, cos, sin, offs_h, offs_i,
            HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Rotates the pairs of ``n_heads`` heads starting at ``base`` in place."""
    first, second = pair_columns(offs_i, HALF, IS_NEOX)
    mask = (offs_h < n_heads)[:, None]
    p1 = base + offs_h[:, None] * stride_h + first[None, :]
    p2 = base + offs_h[:, None] * stride_h + second[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_pair(x1, x2, cos, sin)
    tl.store(p1, o1.to(base.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(base.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, HALF)
    offs_h = tl.arange(0, BLOCK_H)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i).to(tl.float32)[None, :]
    _rotate(q_ptr + t * stride_qt, stride_qh, NUM_HEADS, cos, sin, offs_h, offs_i, HALF, IS_NEOX)
    _rotate(k_ptr + t * stride_kt, stride_kh, NUM_KV_HEADS, cos, sin, offs_h, offs_i, HALF,
            IS_NEOX)


def supports_rotary_dim(rotary_dim: int) -> bool:
    """Gives whether the kernel can rotate this many dims: half of them tile with tl.arange,
    which needs a power of two (every common rotary_dim, 32..256, is one)."""
    half = rotary_dim // 2
    return half > 0 and half & (half - 1) == 0


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (q, k) rotated in place by each token's position."""
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    assert supports_rotary_dim(rotary_dim), f"rotary_dim={rotary_dim} must be 2 * 2^n"
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k need a dense head_dim"
    if positions.shape[0]:
        _rotary_kernel[(positions.shape[0],)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            NUM_HEADS=q.shape[1], NUM_KV_HEADS=k.shape[1], HALF=half,
            BLOCK_H=triton.next_power_of_2(max(q.shape[1], k.shape[1])), IS_NEOX=is_neox,
            num_warps=4, **pdl_args(q),
        )
    return q, k


def rotary_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0,
                         dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> torch.Tensor:
    """Gives the [max_position, rotary_dim] table of cosines then sines (float32 math)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives rotated copies of (q, k) computed with torch in float32."""
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, half] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x = x.float().clone()
        rot = x[..., :rotary_dim]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            rot[:] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2].clone(), rot[..., 1::2].clone()
            rot[..., 0::2] = x1 * cos - x2 * sin
            rot[..., 1::2] = x2 * cos + x1 * sin
        return x

    return rotate(q).to(q.dtype), rotate(k).to(k.dtype)
