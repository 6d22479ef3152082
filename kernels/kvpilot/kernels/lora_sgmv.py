"""Batched LoRA for a mixed batch (punica's SGMV, as vLLM's `lora_shrink`/`lora_expand`):
out[t] += (x[t] @ A[s]^T) @ B[s]^T with s = slots[t] (-1: the base model, nothing added).

A: [S, R, K] (S adapter slots, R the stacked rank), B: [S, N, R] with the adapter's scale
already folded in. Tokens are grouped by slot on the device once per step (`group_by_slot`:
a stable argsort and per-slot counts, no host sync), so a program multiplies BLOCK_M tokens of one
adapter with `tl.dot`. The grid is (token blocks, column blocks, S) whatever the mix; a
program past its slot's token count exits at once. Fixed grid and no host reads make the
pair safe inside a CUDA graph. Shrink writes float32 [T, R]; expand adds into `out` in
place (each token belongs to one slot, so no two programs write one row).

Shrink splits K over SPLIT_K programs when the batch has few token blocks (decode): with
one program per slot and rank block, a decode step's shrink was one program per adapter
walking all of K (3072 for a 0.6B model's down_proj) in 32-wide steps, ~10-30 us of
latency on an almost idle GPU, per seam and layer. Split, each program reads a K slice
and adds its partial product into the zeroed float32 [T, R] with atomics (as vLLM's
lora_shrink does); the order of those adds varies, so the delta is not bitwise
reproducible from run to run (float32 rounding in rank space). Over 32 token blocks
(512 tokens): no split, plain stores. A caller running many seams per forward passes
`tmp`, a slice of one workspace it zeroed once (one memset per forward, not per seam).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit


def lora_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    """Gives the LoRA delta [T, N] in x's dtype (torch: one pair of matmuls per slot present)."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype, device=x.device)
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        out.index_copy_(0, rows, (x[rows] @ a[slot].T) @ b[slot].T)
    return out


def group_by_slot(slots: torch.Tensor, num_slots: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gives (token ids sorted by slot, tokens per slot [S + 1], first index per slot [S + 1]);
    entry 0 of the last two is the base model's (slot -1)."""
    shifted = slots.long() + 1
    order = torch.argsort(shifted, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, shifted, torch.ones_like(shifted, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return order, counts, starts


@jit
def _shrink_kernel(x_ptr, a_ptr, tmp_ptr, order_ptr, counts_ptr, starts_ptr, R, K,
                   stride_xt, stride_as, stride_ar, stride_tt,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr):
    pid_mk, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_m, pid_k = pid_mk // SPLIT_K, pid_mk % SPLIT_K
    count = tl.load(counts_ptr + slot + 1)
    m0 = pid_m * BLOCK_M
    if m0 >= count:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot + 1) + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < R
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + (k0 + offs_k)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_n[:, None] * stride_ar + (k0 + offs_k)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a.to(x.dtype)))
    ptrs = tmp_ptr + rows[:, None] * stride_tt + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.atomic_add(ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@jit
def _expand_kernel(tmp_ptr, b_ptr, out_ptr, order_ptr, counts_ptr, starts_ptr, N, R,
                   stride_tt, stride_bs, stride_bn, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot + 1)
    m0 = pid_m * BLOCK_M
    if m0 >= count:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot + 1) + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_ok = (r0 + offs_r) < R
        t = tl.load(tmp_ptr + rows[:, None] * stride_tt + (r0 + offs_r)[None, :],
                    mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + (r0 + offs_r)[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(t, tl.trans(b.to(tl.float32)))
    mask = m_ok[:, None] & n_ok[None, :]
    ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
    prev = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


_SPLIT_PROGRAMS = 64  # shrink's programs per slot and rank block when it splits K
BLOCK_M = 16  # tokens per program


def shrink_splits(tokens: int) -> bool:
    """Whether shrink splits K (by default) for a batch of `tokens`: at most 32 token blocks."""
    return triton.cdiv(tokens, BLOCK_M) <= _SPLIT_PROGRAMS // 2


def split_k_for(tokens: int, k: int, block_k: int = 64) -> int:
    """Gives shrink's default SPLIT_K: enough for ~64 programs per slot and rank block, at
    most one per BLOCK_K of K; 1 where it does not split (`shrink_splits`)."""
    if not shrink_splits(tokens):
        return 1
    return min(triton.cdiv(k, block_k), _SPLIT_PROGRAMS // triton.cdiv(tokens, BLOCK_M))


def lora_sgmv_(out: torch.Tensor,  # [T, N], rows dense: the base layer's output, added to
               x: torch.Tensor,  # [T, K], rows dense
               a: torch.Tensor,  # [S, R, K]
               b: torch.Tensor,  # [S, N, R]
               grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # group_by_slot's
               block_m: int = BLOCK_M, block_n: int = 32, block_k: int = 64,
               split_k: int | None = None, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Adds the LoRA delta of every token's slot to `out` in place; gives `out`. `grouped`
    is `group_by_slot(slots, S)`, computed once per step for every layer. `split_k`: the
    programs that share one token block's K (default `split_k_for`). `tmp`: a zeroed float32
    [T, R] (rows may be strided) for shrink's output, else one is made."""
    tokens, k = x.shape
    num_slots, rank, _ = a.shape
    n = b.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1, "x and out rows must be dense"
    assert a.is_contiguous() and b.is_contiguous(), "the slot stacks must be contiguous"
    order, counts, starts = grouped
    block_r = max(16, triton.next_power_of_2(min(rank, 64)))
    grid_m = triton.cdiv(tokens, block_m)
    if split_k is None:
        split_k = split_k_for(tokens, k, block_k)
    if tmp is None:
        tmp = (torch.zeros if split_k > 1 else torch.empty)(tokens, rank, dtype=torch.float32,
                                                            device=x.device)
    assert tmp.shape == (tokens, rank) and tmp.dtype == torch.float32 and tmp.stride(1) == 1
    _shrink_kernel[(grid_m * split_k, triton.cdiv(rank, block_r), num_slots)](
        x, a, tmp, order, counts, starts, rank, k,
        x.stride(0), a.stride(0), a.stride(1), tmp.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_r, BLOCK_K=block_k, SPLIT_K=split_k)
    _expand_kernel[(grid_m, triton.cdiv(n, block_n), num_slots)](
        tmp, b, out, order, counts, starts, n, rank,
        tmp.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return out
