"""Qwen3's per-head q/k RMSNorm and the rotary embedding in one launch, in place.

Unfused, a Qwen3 layer runs three small kernels between the qkv projection and
attention: ``rms_norm`` on q, ``rms_norm`` on k, then ``rotary_embedding``. In decode
each is launch-bound, so this kernel does all three. It rounds exactly as that chain
does, so swapping it in leaves a model's output bit-equal: each head's statistics in
float32 over head_dim (the same 1-D reduction ``_rmsnorm_kernel`` makes, so the same
sum), the normalised value rounded to the tensor's dtype, multiplied by the weight and
rounded again (what ``rms_norm`` stores), then rotated in float32 with the same spelled-out
multiply-adds as ``_rotary_kernel`` (``rotary.rotate_pair``; neox or gpt-j pairs) and
rounded once more. Dimensions past ``rotary_dim`` (partial rotary) are normalised but not
rotated. On a GPU the bits match for head_dim > 32 (``matches_unfused_bits``).

One program per token and one to four heads (`heads_per_program_for`), q heads first
then k heads: each head's row is read once for the statistics and once more, pairwise, to
rotate (the second read hits L1).

Given the layer's paged KV cache and the step's slot mapping, it also caches the step's
K/V rows (what `kv_cache_write.kv_cache_write` does, same bits, fp8 included): each k head
stores its finished row to the cache as well, and the v heads' rows are copied. The
attention backend is then told not to write them again: one launch per layer fewer.

`rotary_kv_write` runs the same kernel without the norms, for layers that have none
(Llama's): the rotary kernel and the KV-cache write in one launch, with their bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE
from kvpilot.kernels.kv_cache_write import cache_value
from kvpilot.kernels.pdl import pdl_args, wait_for_previous
from kvpilot.kernels.rmsnorm import rms_norm_ref
from kvpilot.kernels.rotary import (
    pair_columns,
    rotary_embedding_ref,
    rotate_pair,
    supports_rotary_dim,
)


@jit
def _norm_rotate_head(
    t, h, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cache_row, cos, sin, weights,
    stride_qt, stride_qh, stride_kt, stride_kh, n_cols, eps, k_scale,
    store_cache, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    IS_NEOX: tl.constexpr, KV_FP8: tl.constexpr, NORM: tl.constexpr,
):
    """Norms (NORM) and rotates q head `h` (or k head h - NUM_HEADS) of token `t` in place;
    a k row goes to `cache_row` as well where `store_cache`. `cos`, `sin` (the token's) and
    `weights` (the q and k weights' pair columns, `_pair_weights`) come loaded."""
    offs = tl.arange(0, HEAD_DIM)
    cache_dtype: tl.constexpr = cache_row.dtype.element_ty
    q_w1, q_w2, k_w1, k_w2 = weights
    if h < NUM_HEADS:
        row = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = q_weight_ptr
        w1, w2 = q_w1, q_w2
    else:
        row = k_ptr + t * stride_kt + (h - NUM_HEADS) * stride_kh
        w_ptr = k_weight_ptr
        w1, w2 = k_w1, k_w2
    dtype = row.dtype.element_ty

    x = tl.load(row + offs).to(tl.float32)
    rstd = 1.0
    if NORM:  # the statistics exactly as _rmsnorm_kernel computes them (same tile, same sum)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)

    # the rotated pairs, each normed and rounded as rms_norm stores it, then rotated as
    # _rotary_kernel does; every store depends on rstd, so all of the row is read first
    offs_i = tl.arange(0, HALF)
    first, second = pair_columns(offs_i, HALF, IS_NEOX)
    n1 = tl.load(row + first).to(tl.float32)
    n2 = tl.load(row + second).to(tl.float32)
    if NORM:
        n1 = ((n1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        n2 = ((n2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    o1, o2 = rotate_pair(n1, n2, cos, sin)
    tl.store(row + first, o1.to(dtype))
    tl.store(row + second, o2.to(dtype))
    if store_cache:
        tl.store(cache_row + first, cache_value(o1.to(dtype), k_scale, KV_FP8, cache_dtype))
        tl.store(cache_row + second, cache_value(o2.to(dtype), k_scale, KV_FP8, cache_dtype))

    if 2 * HALF < HEAD_DIM:  # partial rotary: the rest is only normalised (NORM), or kept
        tail = offs >= 2 * HALF
        if NORM:
            w = tl.load(w_ptr + offs, mask=tail, other=0.0).to(tl.float32)
            normed = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype)
            tl.store(row + offs, normed, mask=tail)
        else:
            normed = x.to(dtype)
        if store_cache:
            tl.store(cache_row + offs, cache_value(normed, k_scale, KV_FP8, cache_dtype),
                     mask=tail)


@jit
def _pair_weights(q_weight_ptr, k_weight_ptr, first, second, HALF: tl.constexpr,
                  NORM: tl.constexpr):
    """Gives the q and k norm weights at the rotated pairs' columns as float32 (zeros when
    there is no NORM)."""
    if NORM:
        return (tl.load(q_weight_ptr + first).to(tl.float32),
                tl.load(q_weight_ptr + second).to(tl.float32),
                tl.load(k_weight_ptr + first).to(tl.float32),
                tl.load(k_weight_ptr + second).to(tl.float32))
    zero = tl.zeros([HALF], dtype=tl.float32)
    return zero, zero, zero, zero


@jit
def _qk_norm_rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr,
    v_ptr, cache_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, n_cols, eps,
    stride_kv, stride_slot, k_scale, v_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, IS_NEOX: tl.constexpr, WRITE_KV: tl.constexpr, KV_FP8: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, HEAD_DIM)
    cache_dtype: tl.constexpr = cache_ptr.dtype.element_ty
    slot = -1
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # the token's position, cos/sin and the norm weights are loaded once for all the
    # program's heads, before the first head's row is summed: their loads are then in flight
    # with the row's, not a round trip (position, then cos/sin) after the sum
    offs_i = tl.arange(0, HALF)
    first, second = pair_columns(offs_i, HALF, IS_NEOX)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i).to(tl.float32)
    weights = _pair_weights(q_weight_ptr, k_weight_ptr, first, second, HALF, NORM)
    # heads 0..NUM_HEADS-1 are q's, then k's, then (WRITE_KV) v's, HEADS_PER_PROGRAM a program
    # unrolled, so the heads' loads are in flight together (triton's stub types it NoReturn)
    for i in tl.static_range(HEADS_PER_PROGRAM):  # pyright: ignore[reportGeneralTypeIssues]
        h = tl.program_id(1) * HEADS_PER_PROGRAM + i
        # the head's row of the cache: K for a k head, V (past the K half) for a v head
        cache_row = cache_ptr + slot * stride_slot + ((h - NUM_HEADS) % NUM_KV_HEADS) * HEAD_DIM
        if h < NUM_HEADS + NUM_KV_HEADS:
            store_cache = False
            if WRITE_KV:
                store_cache = (h >= NUM_HEADS) & (slot >= 0)
            _norm_rotate_head(
                t, h, q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, cache_row, cos, sin, weights,
                stride_qt, stride_qh, stride_kt, stride_kh, n_cols, eps, k_scale, store_cache,
                NUM_HEADS, HEAD_DIM, HALF, IS_NEOX, KV_FP8, NORM)
        elif WRITE_KV:  # noqa: SIM102 (a constexpr branch, resolved when compiling)
            if (h < NUM_HEADS + 2 * NUM_KV_HEADS) & (slot >= 0):  # a v head: copied
                v = tl.load(v_ptr + t * stride_vt + (h - NUM_HEADS - NUM_KV_HEADS) * stride_vh
                            + offs)
                tl.store(cache_row + stride_kv + offs,
                         cache_value(v, v_scale, KV_FP8, cache_dtype))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports_qk_norm_rotary(head_dim: int, rotary_dim: int) -> bool:
    """Gives whether the kernel handles these sizes: head_dim and rotary_dim / 2 tile with
    tl.arange, so both must be powers of two, and rotary_dim may not exceed head_dim."""
    return _power_of_two(head_dim) and supports_rotary_dim(rotary_dim) and \
        rotary_dim % 2 == 0 and rotary_dim <= head_dim


def matches_unfused_bits(head_dim: int) -> bool:
    """Gives whether on a GPU the kernel reproduces rms_norm's bits for rows this long: rows
    that span more than one warp (head_dim > 32; every Qwen3 has 128).

    The compiler fuses a lane's own x*x into the first add of the warp's butterfly sum, so
    the lanes of a warp end with sums that differ in the last bit. A row reduced across
    warps ends in shared memory, where every lane reads one sum; a row within one warp keeps
    each lane's own, and rms_norm normalises element i with lane i's, which this kernel,
    pairing elements i and i + rotary_dim / 2 in one lane, cannot follow. (Measured on an
    H100: head_dim 64, 128 and 256 bit-equal, 32 about 4% of elements a last bit apart.)"""
    return head_dim > 32


def qk_norm_rotary(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous (may be a qkv view)
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], likewise
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,  # [head_dim]
    eps: float,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    is_neox: bool = True,
    v: torch.Tensor | None = None,  # [T, num_kv_heads, head_dim]: with the two below,
    kv_cache: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor | None = None,  # [T] int64, -1 = do not write
    kv_scales: tuple[float, float] = (1.0, 1.0),  # (k, v) scales of an fp8 cache
    heads_per_program: int | None = None,  # None: `heads_per_program_for(T)`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (q, k), each head RMS-normed with its weight then rotated by its token's
    position, written in place; the same bits as rms_norm on q and k then
    rotary_embedding. Given `v`, `kv_cache` and `slot_mapping`, it also writes the finished
    k and v rows into the cache, as `kv_cache_write` would after it. Raises ValueError for
    shapes the kernel cannot handle."""
    _check(positions, q, k, q_weight, k_weight, cos_sin_cache)
    return _launch(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, is_neox, v,
                   kv_cache, slot_mapping, kv_scales, heads_per_program)


def rotary_kv_write(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], head_dim contiguous (may be a qkv view)
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], likewise
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    kv_scales: tuple[float, float] = (1.0, 1.0),
    is_neox: bool = True,
    heads_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (q, k) rotated in place, having written the rotated k and v rows into the cache:
    `rotary_embedding` then `kv_cache_write` in one launch, with their bits (a layer without
    q/k norms, Llama's). Raises ValueError for shapes the kernel cannot handle."""
    _check(positions, q, k, None, None, cos_sin_cache)
    return _launch(positions, q, k, None, None, 0.0, cos_sin_cache, is_neox, v, kv_cache,
                   slot_mapping, kv_scales, heads_per_program)


def _launch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
            cos_sin_cache: torch.Tensor, is_neox: bool, v: torch.Tensor | None,
            kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
            kv_scales: tuple[float, float], heads_per_program: int | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel: norms where the weights are given, the cache written where it
    is."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    write_kv = kv_cache is not None
    if write_kv:
        _check_cache(k, v, kv_cache, slot_mapping)
    else:  # placeholders the kernel never reads (WRITE_KV off)
        v, kv_cache, slot_mapping = k, k, positions
    norm = q_weight is not None and k_weight is not None
    if not norm:  # placeholders the kernel never reads (NORM off)
        q_weight = k_weight = cos_sin_cache
    assert v is not None and kv_cache is not None and slot_mapping is not None
    assert q_weight is not None and k_weight is not None
    if tokens:
        heads_per_program = heads_per_program or heads_per_program_for(tokens)
        heads = num_heads + num_kv_heads * (2 if write_kv else 1)
        _qk_norm_rotary_kernel[(tokens, triton.cdiv(heads, heads_per_program))](
            positions, q, k, q_weight, k_weight, cos_sin_cache, v, kv_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos_sin_cache.stride(0), head_dim, eps, kv_cache.stride(0), kv_cache.stride(2),
            *kv_scales,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF=cos_sin_cache.shape[1] // 2, IS_NEOX=is_neox, WRITE_KV=write_kv,
            KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
            HEADS_PER_PROGRAM=heads_per_program, NORM=norm,
            num_warps=4,  # as rms_norm launches a row this long: the same reduction
            **pdl_args(q),
        )
    return q, k


def heads_per_program_for(tokens: int) -> int:
    """Gives how many heads one program norms (and caches) at a batch of `tokens`: one
    (most programs) for a few tokens, more as the tokens fill the GPU. Measured on an H100
    (Qwen3-0.6B: 16 q, 8 KV heads; bf16; KV write included; in a CUDA graph), us a launch:
    1 token 1.7 / 2.2 / 3.1 at 1 / 2 / 4 heads; 64 tokens 3.1 / 3.0 / 3.5; 128 tokens
    4.3 / 4.1 / 3.9; 256 tokens 7.1 / 5.9 / 6.0 (the two launches it replaces: 2.6, 3.9,
    5.0 and 7.1)."""
    return 1 if tokens <= 16 else 2 if tokens < 128 else 4


def _check_cache(k: torch.Tensor, v: torch.Tensor | None, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor | None) -> None:
    if v is None or slot_mapping is None:
        raise ValueError("writing the KV cache needs v, kv_cache and slot_mapping together")
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} with a "
                         "contiguous head_dim")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:] \
            or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be a contiguous [2, blocks, "
                         f"block_size, {k.shape[1]}, {k.shape[2]}]")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [T] with "
                         f"T={k.shape[0]}")


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
           cos_sin_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, heads, head_dim]: got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in tokens and "
                         "head_dim")
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(f"positions {tuple(positions.shape)} must be [T] with T={tokens}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k need a contiguous head_dim (stride 1)")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.shape != (head_dim,) or w.stride(0) != 1):
            raise ValueError(f"{name} {tuple(w.shape)} must be a contiguous [{head_dim}]")
    if q_weight is not None and k_weight is not None and q_weight.dtype != k_weight.dtype:
        raise ValueError(f"q_weight ({q_weight.dtype}) and k_weight ({k_weight.dtype}) "
                         "must share a dtype")
    if not _power_of_two(head_dim):
        raise ValueError(f"head_dim={head_dim} must be a power of two")
    rotary_dim = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1 or \
            not supports_qk_norm_rotary(head_dim, rotary_dim):
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be a dense "
                         "[max_position, rotary_dim] with rotary_dim = 2 * 2^n <= "
                         f"head_dim={head_dim}")


def qk_norm_rotary_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives normed-then-rotated copies of (q, k): rms_norm_ref per head, then
    rotary_embedding_ref (inputs unchanged)."""
    qn = rms_norm_ref(q, q_weight, eps)
    kn = rms_norm_ref(k, k_weight, eps)
    assert isinstance(qn, torch.Tensor) and isinstance(kn, torch.Tensor)
    return rotary_embedding_ref(positions, qn.to(q.dtype), kn.to(k.dtype), cos_sin_cache,
                                is_neox)
