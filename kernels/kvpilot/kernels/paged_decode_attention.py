"""Paged decode attention: split-K flash-decoding over a paged KV cache, GQA-grouped.

One query token per sequence attends to that sequence's ``seq_len`` cached
tokens. The cache of one layer is ``[2, num_blocks, block_size, num_kv_heads,
head_dim]``; token ``p`` of sequence ``b`` sits in block ``block_tables[b, p //
block_size]`` at offset ``p % block_size``.

Stage 1 runs one program per (KV head, sequence, split): it loads each K/V tile
once and scores it against *all* query heads of that KV head's group at once
(a ``[BLOCK_H, BLOCK_N]`` dot), so GQA never re-reads the cache. Each split
covers ``ceil(seq_len / num_splits)`` tokens, computed on the device from
``seq_len``: the launch shape depends on nothing but the batch size, which is
what lets CUDA graphs replay it at any context length. Stage 2 merges the
splits' partial outputs through their log-sum-exps; with one split (a large batch
fills the GPU alone) stage 1 writes the output itself and stage 2 does not run.
Contexts in one batch differ tenfold (100 to 2,000 tokens in the nano-vllm recipe), so
the launch takes the sequences in the order the caller gives, longest first (the
engine packs that order with each step, `kvpilot.engine.worker.step_batch`): over the recipe's decode steps
that moved KV 5% faster (0.91 -> 0.96 of copy bandwidth, bench/decode_recipe_gpu.py).
An fp8 (E4M3) cache is widened to float32 and multiplied by its per-layer scale
right after each load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE, cached_rows
from kvpilot.kernels.pdl import pdl_args, wait_for_previous


# Arguments that change from step to step are not specialised on (divisibility by 16,
# pointer alignment of sliced views): each distinct specialisation is a fresh compile,
# seconds of stall in the middle of serving.
@jit(do_not_specialize=["num_splits", "stride_bt"],
     do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_split_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    order_ptr, scale, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_slot,
    stride_bt, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the output, no partials to merge
    HAS_ORDER: tl.constexpr,  # the sequences' order in the launch: longest first
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # a sequence's KV heads are neighbours in the launch order, so programs running together
    # read neighbouring bytes of each cached token (all its heads sit side by side)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    if HAS_ORDER:
        seq = tl.load(order_ptr + seq)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # split length rounded up to whole tiles so that tiles never straddle splits
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    k_base = cache_ptr + kv_head * HEAD_DIM
    v_base = k_base + stride_kv
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        valid = pos < end
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE,
                        mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_off = slot[:, None] * stride_slot + offs_d[None, :]
        k = tl.load(k_base + kv_off, mask=valid[:, None], other=0.0)
        v = tl.load(v_base + kv_off, mask=valid[:, None], other=0.0)
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # an empty split (short sequence, or a padded row with seq_len 0) reports
    # lse = -inf, which gives it weight zero in the merge
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DIRECT:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        row = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=head_mask[:, None])
        tl.store(mid_lse_ptr + row, lse, mask=head_mask)


@jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_ot, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    row0 = (seq * NUM_HEADS + head) * num_splits
    lse = tl.load(mid_lse_ptr + row0 + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    o = tl.load(mid_o_ptr + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=(offs_s < num_splits)[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                       num_sms: int = 132) -> int:
    """Gives how many splits fill the GPU: none once there is a program per SM, else ~3
    programs per SM, no split under 256 tokens.

    With a program per SM a split gains nothing and costs the merge's launch. Measured on an
    H100 (bf16, d128, 28 launches in a CUDA graph): 64 sequences x 4 KV heads (a TP=2
    Llama-3-8B shard) took 9.3 / 50.5 / 187.8 us at 192 / 1024 / 4096 tokens unsplit and
    12.6 / 54.7 / 187.2 in two splits; at 128 programs two splits win from 1024 tokens (32.0
    against 36.2 us) and lose at 192 (9.4 against 7.4)."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    want = triton.cdiv(3 * num_sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, 256), 64))


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    num_splits: int = 4,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # (k, v) dequantisation scales of an fp8 cache
    order: torch.Tensor | None = None,  # [B] a permutation of the rows: the launch order
) -> torch.Tensor:
    """Gives the attention output [B, num_heads, head_dim] of each sequence's one query token.

    ``order`` lists the rows in the order their programs start, best longest context first:
    programs are handed to the SMs in launch order, so when the longest contexts start first
    the short ones fill in behind them, instead of one long sequence running on alone at
    the end of the launch while the other SMs idle."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    # two K/V stages of 64 x 256 tokens are 128 KB: halve the tile at head_dim 256
    block_n = block_n or (64 if head_dim <= 128 else 32)
    # slot addressing (block * block_size + offset) * stride needs the dense layout
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    direct = num_splits == 1
    if direct:  # stage 1 writes `out`: the partials' pointers are never read
        mid_o = mid_lse = out
    else:
        mid_o = torch.empty(num_seqs, num_heads, num_splits, head_dim,
                            dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32,
                              device=q.device)
    _decode_split_kernel[(num_kv_heads, num_seqs, num_splits)](
        q, kv_cache, block_tables, seq_lens, mid_o, mid_lse, out,
        seq_lens if order is None else order, scale, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(2),
        block_tables.stride(0), *kv_scales,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        KV_FP8=kv_cache.dtype == FP8_KV_DTYPE, DIRECT=direct,
        HAS_ORDER=order is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q),
    )
    if direct:
        return out
    _decode_merge_kernel[(num_seqs, num_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        SPLITS_P2=max(16, triton.next_power_of_2(num_splits)), **pdl_args(q),
    )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Gives the same output computed in float32 with plain torch, one sequence at a time."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(num_seqs):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = cached_rows(kv_cache[0], slots, kv_scales[0])  # [n, kvh, d]
        v = cached_rows(kv_cache[1], slots, kv_scales[1])
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.to(q.dtype)

