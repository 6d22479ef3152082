"""Unified paged attention: decodes, prompt chunks and verifies in one launch whose grid depends
only on the token count, so a mixed step can be captured whole in a CUDA graph.

The batch is the flat layout of ``engine/attention/metadata.py``, with every token's K/V
already in the paged cache (the step writes them first). The other attention kernels size
their grids from the step's sequences (how many decode rows, the longest query): a graph
replaying them would bake one step's shape into every later one. Here the grid is
``(num_tokens // BLOCK_Q + max_seqs, num_kv_heads)`` for a fixed ``num_tokens`` and
``max_seqs``: sequence ``i`` owns the query blocks from ``query_start_loc[i] // BLOCK_Q + i``
on (one per ``BLOCK_Q`` of its new tokens, the ``+ i`` leaving room for each sequence's
partial block), and a program finds its sequence by binary search over
``query_start_loc``. Programs past a sequence's tokens, and whole padding sequences (query
length 0), return at once. (vLLM's Triton unified attention takes the same layout.)

One program computes ``BLOCK_Q`` tokens x the ``GROUP`` query heads of one KV head, so each
K/V tile gathered from the cache serves the whole GQA group: a decode row reads its context
once per KV head, as the decode kernel does, and a prompt chunk uses the tensor cores over
``BLOCK_Q * GROUP`` rows. Tiles left of the block's first query position need no mask; the
rest are masked causally (key position <= the row's position). An fp8 (E4M3) cache is
widened and scaled by its per-layer scale right after each load.

There is no split over the context: a step with few sequences and long contexts keeps few
programs busy (e.g. four decodes at 32k tokens: 4 x KV heads programs). The mixed steps it
serves are at most 512 tokens (`worker/piecewise_graphs.py`); pure decode steps keep the
split-K decode kernel in their own graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE
from kvpilot.kernels.paged_prefill_attention import LOG2E, _tile_fma, load_paged_kv


@jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Gives the sequence whose query blocks hold `q_block`: the last i with
    query_start_loc[i] // BLOCK_Q + i <= q_block (a binary search; padding sequences of
    length 0 each own one empty block, so the starts strictly increase)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# lengths, tables and the sequence count change every step: no specialisation on them, or
# each new value/alignment would be a fresh compile mid-serving
@jit(do_not_specialize=["stride_bt", "num_seqs"],
     do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _unified_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr, qk_scale,
    num_seqs, stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_slot, stride_bt,
    k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this block's first query token
    if first >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this step's

    # row m is query token first + m // GROUP of query head kv_head * GROUP + m % GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    token = first + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (token < q_len) & (offs_m < BLOCK_Q * GROUP)
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    row_pos = ctx_len + token  # each row's position: it sees keys up to and including it

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = cache_ptr + kv_head * HEAD_DIM
    table = block_tables_ptr + seq * stride_bt
    # keys before the block's first position are seen by every row: whole tiles unmasked
    open_end = (ctx_len + first) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(ctx_len + first + BLOCK_Q, ctx_len + q_len)
    for n0 in range(0, open_end, BLOCK_N):
        k, v = load_paged_kv(k_base, table, n0 + offs_n, open_end, offs_d, stride_kv,
                             stride_slot, k_scale, v_scale, q, BLOCK_SIZE, KV_FP8)
        acc, m_i, l_i = _tile_fma(acc, m_i, l_i, q, k, v, qk_scale, True, False)
    for n0 in range(open_end, kv_end, BLOCK_N):
        pos = n0 + offs_n
        k, v = load_paged_kv(k_base, table, pos, kv_end, offs_d, stride_kv, stride_slot,
                             k_scale, v_scale, q, BLOCK_SIZE, KV_FP8)
        mask = (pos[None, :] < kv_end) & (pos[None, :] <= row_pos[:, None])
        acc, m_i, l_i = _tile_fma(acc, m_i, l_i, q, k, v, qk_scale, mask, True)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def default_blocks(group: int, head_dim: int) -> tuple[int, int, int]:
    """Gives (block_q, block_m, block_n): 64 query rows a program (fewer tokens the larger the
    GQA group; at least 16 rows, tl.dot's least), 64-key tiles (32 past head_dim 128)."""
    block_q = max(64 // group, 1)
    block_m = max(triton.next_power_of_2(block_q * group), 16)
    return block_q, block_m, 64 if head_dim <= 128 else 32


def grid_size(num_tokens: int, max_seqs: int, block_q: int) -> int:
    """Gives the query blocks a launch covers: enough for any `max_seqs` sequences of
    `num_tokens` tokens in all (each adds at most one partial block)."""
    return num_tokens // block_q + max_seqs


def unified_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], K/V written
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32; padding sequences repeat the last value
    seq_lens: torch.Tensor,  # [S] int32; 0 for padding sequences
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]; rows of no sequence are left as they are
    kv_scales: tuple[float, float] = (1.0, 1.0),
    block_q: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Gives `out` holding the causal attention of every sequence's new tokens over its whole
    context in the cache; one launch whose shape depends on T and S only (graph-safe)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert q.stride(2) == 1 and out.stride(2) == 1, "head_dim must be dense in q and out"
    default_q, _, default_n = default_blocks(group, head_dim)
    block_q, block_n = block_q or default_q, block_n or default_n
    block_m = max(triton.next_power_of_2(block_q * group), 16)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return out
    grid = (grid_size(q.shape[0], num_seqs, block_q), num_kv_heads)
    _unified_kernel[grid](
        q, kv_cache, block_tables, query_start_loc, seq_lens, out, scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0),
        kv_cache.stride(2), block_tables.stride(0), *kv_scales,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
