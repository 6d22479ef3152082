"""Batched LoRA for a mixed batch (punica's SGMV, as vLLM's `lora_shrink`/`lora_expand`):
out[t] += (x[t] @ A[s]^T) @ B[s]^T with s = slots[t] (-1: the base model, nothing added).

A: [S, R, K] (S adapter slots, R the stacked rank), B: [S, N, R] with the adapter's scale
already folded in. Once per step `group_by_slot` sorts the tokens by slot on the device (a
stable argsort, per-slot counts) and cuts each slot's run into blocks of at most BLOCK_M
tokens: a block table of MAX_BLOCKS = cdiv(T, BLOCK_M) + S rows (each slot adds at most one
partial block), each row a slot (-1: unused), its first index into the sorted order and its
token count. Base-model tokens get no block. The grid is a segment grid over that table:
shrink (MAX_BLOCKS * SPLIT_K, cdiv(R, BLOCK_R)), expand (MAX_BLOCKS, cdiv(N, BLOCK_N)); a
program multiplies its block's tokens with `tl.dot`, and one on an unused row exits at once.
Table and grid have fixed shapes and nothing is read on the host, so the pair is safe inside
a CUDA graph. Shrink writes float32 [T, R]; expand adds into `out` in place (each token
belongs to one block, so no two programs write one element).

Why blocks, not (token blocks, column blocks, S slots): on an H100 (decode, batch 64, CUDA
graphs) with LoRA on and every request on the base model, each kernel of that grid cost
~2.4 us (Qwen3-0.6B shape) to ~4.8 us (Llama-3-8B shape) with no program doing work; an 8B
gate_up expand (N = 28672, then BLOCK_N 32) launched 4 x 896 x 8 ~ 28k programs that load
a count and exit, and with 8 adapters x 8 tokens only 1 in 4 did work. Here that expand has
12 x 448 programs (BLOCK_N 64, `EXPAND_BLOCK_N`), 8 x 448 of them busy.

A merged projection (q|k|v, gate|up) stacks its parts' adapters along the rank, part p's
B nonzero only in its own rank columns (`lora.layers`). Given the parts' sizes, expand
reads only a column block's own part's columns: a third of q|k|v's B and half of
gate|up's, where the zeros were read and multiplied before.

Shrink splits K over SPLIT_K programs per block when the batch has few token blocks
(decode): unsplit, a decode step's shrink was one program per adapter walking all of K
(3072 for a 0.6B model's down_proj) in 32-wide steps, ~10-30 us of latency on an almost
idle GPU, per seam and layer. Split, each program reads a K slice and adds its partial
product into the zeroed float32 [T, R] with atomics (as vLLM's lora_shrink does); the order
of those adds varies, so the delta is not bitwise reproducible from run to run (float32
rounding in rank space). Over 32 token blocks (512 tokens): no split, plain stores. A caller
running many seams per forward passes `tmp`, a slice of one workspace it zeroed once (one
memset per forward, not per seam).

Both kernels launch with PDL where the GPU has it (`kvpilot.kernels.pdl`, as the decode
step's other Triton kernels): each program waits for the kernel before it first thing, so a
launch overlaps only the previous grid's drain. A decode step runs eight of them per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.pdl import pdl_args, wait_for_previous

BLOCK_M = 16  # tokens per block (and per program)
EXPAND_BLOCK_N = 64  # expand's output columns per program
_SPLIT_PROGRAMS = 64  # shrink's programs per rank block for a batch's worth of blocks


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


@dataclass(frozen=True)
class SlotGroups:
    """A step's tokens grouped by slot (`group_by_slot`), all int32 on the device."""

    order: torch.Tensor  # [T] token ids sorted by slot, the base model's (-1) first
    counts: torch.Tensor  # [S + 1] tokens per slot, entry 0 the base model's
    starts: torch.Tensor  # [S + 1] each slot's first index into `order`, entry 0 the base's
    block_slot: torch.Tensor  # [MAX_BLOCKS] each block's slot, -1 where unused
    block_start: torch.Tensor  # [MAX_BLOCKS] its first index into `order` (0 where unused)
    block_count: torch.Tensor  # [MAX_BLOCKS] its tokens, 1..block_m (0 where unused)
    block_m: int  # the most tokens a block holds


def max_blocks(tokens: int, num_slots: int, block_m: int = BLOCK_M) -> int:
    """Gives the block table's rows: every slot's blocks fit, as each adds at most one
    partial block to the cdiv(tokens, block_m) full ones."""
    return triton.cdiv(tokens, block_m) + num_slots


def group_by_slot(slots: torch.Tensor, num_slots: int, block_m: int = BLOCK_M) -> SlotGroups:
    """Groups the tokens of `slots` (-1: base) by slot and cuts each slot's run into blocks of
    at most `block_m` tokens, slot by slot; unused rows of the table come last. Torch ops on
    the device with fixed shapes and no host read, so a CUDA graph can capture it."""
    shifted = slots.long() + 1
    order = torch.argsort(shifted, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, shifted, torch.ones_like(shifted, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    used, used_starts = counts[1:], starts[1:]  # the adapters' slots, not the base
    blocks = (used + block_m - 1) // block_m  # per slot
    ends = torch.cumsum(blocks, 0, dtype=torch.int32)  # one past each slot's last block
    ids = torch.arange(max_blocks(slots.shape[0], num_slots, block_m), dtype=torch.int32,
                       device=slots.device)
    # a block's slot: the first whose blocks end past it (an empty slot ends where its
    # predecessor does, so it is skipped); num_slots past the last used block
    slot = torch.searchsorted(ends, ids, right=True, out_int32=True)
    valid = slot < num_slots
    at = slot.clamp(max=num_slots - 1).long()
    first = (ids - (ends - blocks)[at]) * block_m  # the block's first token within its slot
    return SlotGroups(
        order, counts, starts,
        block_slot=torch.where(valid, slot, -1),
        block_start=torch.where(valid, used_starts[at] + first, 0),
        block_count=torch.where(valid, (used[at] - first).clamp(max=block_m), 0),
        block_m=block_m)


@jit
def _shrink_kernel(x_ptr, a_ptr, tmp_ptr, order_ptr, block_slot_ptr, block_start_ptr,
                   block_count_ptr, R, K, stride_xt, stride_as, stride_ar, stride_tt,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid_bk, pid_n = tl.program_id(0), tl.program_id(1)
    block, pid_k = pid_bk // SPLIT_K, pid_bk % SPLIT_K
    slot = tl.load(block_slot_ptr + block)
    if slot < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.load(block_count_ptr + block)
    rows = tl.load(order_ptr + tl.load(block_start_ptr + block) + offs_m, mask=m_ok, other=0)
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
def _expand_kernel(tmp_ptr, b_ptr, out_ptr, order_ptr, block_slot_ptr, block_start_ptr,
                   block_count_ptr, N, P0_END, P1_END, stride_tt, stride_bs, stride_bn,
                   stride_ot, R_PART: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    block, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slot_ptr + block)
    if slot < 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < tl.load(block_count_ptr + block)
    rows = tl.load(order_ptr + tl.load(block_start_ptr + block) + offs_m, mask=m_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    # the rank columns of this column block's part (its part's B is zero elsewhere)
    first = pid_n * BLOCK_N
    r_base = tl.where(first >= P1_END, 2 * R_PART, tl.where(first >= P0_END, R_PART, 0))
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R_PART, BLOCK_R):
        r_ok = (r0 + offs_r) < R_PART
        cols = r_base + r0 + offs_r
        t = tl.load(tmp_ptr + rows[:, None] * stride_tt + cols[None, :],
                    mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + cols[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.dot(t, tl.trans(b.to(tl.float32)))
    mask = m_ok[:, None] & n_ok[None, :]
    ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
    prev = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def expand_parts(parts: tuple[int, ...], n: int, rank: int, block_n: int
                 ) -> tuple[int, int, int]:
    """Gives expand's (P0_END, P1_END, R_PART): where parts 0 and 1 end among the output
    rows and each part's rank columns. A column block reads only its part's columns, so
    every part but the last must end on a multiple of `block_n` and the rank must split
    evenly; otherwise (or for one part) the whole rank is read everywhere (n, n, rank)."""
    if len(parts) < 2:
        return n, n, rank
    assert len(parts) <= 3 and sum(parts) == n, f"parts {parts} do not cover {n} rows"
    ends = [sum(parts[:i + 1]) for i in range(len(parts) - 1)]
    if rank % len(parts) or any(end % block_n for end in ends):
        return n, n, rank
    return ends[0], ends[1] if len(ends) > 1 else n, rank // len(parts)


def shrink_splits(tokens: int) -> bool:
    """Whether shrink splits K (by default) for a batch of `tokens`: at most 32 token blocks."""
    return triton.cdiv(tokens, BLOCK_M) <= _SPLIT_PROGRAMS // 2


def split_k_for(tokens: int, k: int, block_k: int = 64) -> int:
    """Gives shrink's default SPLIT_K, the programs sharing one block's K: ~64 programs per
    rank block over the batch's cdiv(tokens, BLOCK_M) token blocks (its busy blocks when
    one slot holds all its tokens; a mix of slots has more, each split as much), at most
    one per BLOCK_K of K; 1 where it does not split (`shrink_splits`)."""
    if not shrink_splits(tokens):
        return 1
    return min(triton.cdiv(k, block_k), _SPLIT_PROGRAMS // triton.cdiv(tokens, BLOCK_M))


def lora_sgmv_(out: torch.Tensor,  # [T, N], rows dense: the base layer's output, added to
               x: torch.Tensor,  # [T, K], rows dense
               a: torch.Tensor,  # [S, R, K]
               b: torch.Tensor,  # [S, N, R]
               grouped: SlotGroups,  # group_by_slot's
               block_n: int = EXPAND_BLOCK_N, block_k: int = 64,
               split_k: int | None = None, tmp: torch.Tensor | None = None,
               parts: tuple[int, ...] = ()) -> torch.Tensor:
    """Adds the LoRA delta of every token's slot to `out` in place; gives `out`. `grouped`
    is `group_by_slot(slots, S)`, computed once per step for every layer; its block_m is
    the kernels' BLOCK_M. `split_k`: the programs that share one block's K (default
    `split_k_for`). `tmp`: a zeroed float32 [T, R] (rows may be strided) for shrink's
    output, else one is made. `parts`: a merged projection's output rows per part (at most
    3, summing to N), whose B is nonzero only in part p's R/len(parts) rank columns from
    p*R/len(parts) (`lora.layers` stacks them so): expand then reads only those (see
    `expand_parts`)."""
    tokens, k = x.shape
    rank = a.shape[1]
    n = b.shape[1]
    assert x.stride(1) == 1 and out.stride(1) == 1, "x and out rows must be dense"
    assert a.is_contiguous() and b.is_contiguous(), "the slot stacks must be contiguous"
    assert grouped.order.shape[0] == tokens, "grouped is for another batch"
    num_blocks = grouped.block_slot.shape[0]
    block_r = max(16, triton.next_power_of_2(min(rank, 64)))
    if split_k is None:
        split_k = split_k_for(tokens, k, block_k)
    if tmp is None:
        tmp = (torch.zeros if split_k > 1 else torch.empty)(tokens, rank, dtype=torch.float32,
                                                            device=x.device)
    assert tmp.shape == (tokens, rank) and tmp.dtype == torch.float32 and tmp.stride(1) == 1
    table = (grouped.order, grouped.block_slot, grouped.block_start, grouped.block_count)
    p0_end, p1_end, r_part = expand_parts(parts, n, rank, block_n)
    pdl = pdl_args(x)
    _shrink_kernel[(num_blocks * split_k, triton.cdiv(rank, block_r))](
        x, a, tmp, *table, rank, k,
        x.stride(0), a.stride(0), a.stride(1), tmp.stride(0),
        BLOCK_M=grouped.block_m, BLOCK_N=block_r, BLOCK_K=block_k, SPLIT_K=split_k,
        **pdl)
    _expand_kernel[(num_blocks, triton.cdiv(n, block_n))](
        tmp, b, out, *table, n, p0_end, p1_end,
        tmp.stride(0), b.stride(0), b.stride(1), out.stride(0), R_PART=r_part,
        BLOCK_M=grouped.block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(min(r_part, 64))), **pdl)
    return out
