# Gluon types a kernel's compile-time values (layouts, shapes, stage counts) as `constexpr`,
# which pyright cannot follow through layout constructors and arithmetic: these six rules are
# off for this file only, every other rule still applies to it.
# pyright: reportAssignmentType=false, reportArgumentType=false, reportOperatorIssue=false
# pyright: reportGeneralTypeIssues=false, reportIndexIssue=false, reportCallIssue=false
"""Prefill attention for Hopper in Gluon: warp-specialised, persistent, causal.

Triton's language leaves the schedule of a flash-attention loop to the compiler; on an
H100 the best of kvpilot's Triton kernels reached 0.76-0.86 of cuDNN attention (issue 21,
bench/results/attention-H100-2026-11-27-tma/). Gluon, Triton's lower-level dialect, lets
a kernel say which warps do what, and this one is laid out the way FlashAttention-3 is:

- a **loader** warp issues TMA loads of each tile's queries and of K/V blocks into a ring
  of shared-memory stages, and waits on mbarriers for consumers to free them;
- two **consumer** warpgroups each own 64 of a 128-row query tile. Each issues S = Q K^T for
  block j and O += P V for block j-1 as asynchronous warpgroup MMAs, and computes block j's
  softmax while the second runs (the intra-warpgroup overlap). The scale sits in the
  exponent's FMA, and P stays in registers as the MMA's A operand;
- the grid is **persistent** (one program per SM). Tiles are taken in groups of
  (sequence, head) pairs whose K/V fit `L2_BYTES` together, each group's longest (most
  masked-in) tiles first. Every program then reads K/V that its neighbours have just
  brought into L2, and short diagonal tiles fill the tail;
- a warpgroup's finished output half-tile leaves through its query buffer, free once the
  tile's last scores are in: written to shared memory with `stmatrix`, then one TMA store
  of whole rows. Stored from registers instead, with the MMA layout's two adjacent columns a
  thread, the output took 7% of the kernel's time at N=2048 (14% at N=1024).

The batch is the flat layout of `paged_prefill_attention`. Without a cached prefix, sequence
b's queries, keys and values are rows query_start_loc[b] to query_start_loc[b+1] of q, k, v
([tokens, heads, head_dim], heads contiguous in a token), read through TMA descriptors over
[tokens, heads * head_dim]. With prefixes (`PrefixedKV`, decision 0140) its keys and values
are first gathered from the paged cache into one contiguous region per sequence, rows
kv_starts[b] on, the prefix first; query row i then sits at key position prefix + i. A descriptor tile may run into
the next sequence's rows (or past the tensor's end, which reads zeros): those keys lie right
of every stored row's diagonal and are masked by causality alone, and rows past a sequence
are never stored: a half-tile that ends a sequence part-way is stored from registers,
masked, as is every row of an output whose heads are not contiguous.

On an H100 it ran at 1.06 / 1.06 / 1.03x the fastest of torch's SDPA backends at issue 21's
shapes (B=8 N=4096 MHA and 32/8 GQA, B=16 N=2048 GQA, d128 causal; 1.06 / 1.07 / 1.03 on
another; bench/results/issue21-H100-2026-11-28c/). Tested there in bf16 and fp16 at
head_dim 64 and 128; elsewhere `gluon_prefill_ok` says no and `paged_prefill_attention` runs
its Triton kernels. Needs Triton 3.6 or later (Gluon's Hopper API).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvpilot.kernels.jit import Kernel
from kvpilot.kernels.tma_rows import tma_rows_ok

# Triton 3.7 renamed the TMA load (the GPU image runs 3.6)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


def _jit(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """`gluon.jit(fn, **options)` (the decorator when `fn` is omitted), typed as
    kvpilot.kernels.jit types `triton.jit`."""
    if fn is None:
        return lambda kernel: cast(Kernel, gluon.jit(kernel, **options))
    return cast(Kernel, gluon.jit(fn, **options))


LOG2E = 1.4426950408889634
# KVPILOT_GLUON_PREFILL=0 keeps every prefill on the Triton kernels (an A/B switch)
ENABLED = os.environ.get("KVPILOT_GLUON_PREFILL", "1") != "0"
# Sequences with a cached prefix (a long prompt's later chunks) run here too, their keys
# gathered from the paged cache first (`gather_prefixed_kv`), where each has at least
# GATHER_MIN_QUERY new tokens (below that the gather's copy is a large share of the work:
# it moves each prefix key twice more, the attention reads it once per 128 queries) and
# the gathered keys take at most GATHER_MAX_BYTES; KVPILOT_GLUON_PREFIX=0 keeps them on the
# Triton kernels (an A/B switch)
GATHER_PREFIX = os.environ.get("KVPILOT_GLUON_PREFIX", "1") != "0"
GATHER_MIN_QUERY, GATHER_MAX_BYTES = 128, 1 << 30
HEAD_DIMS = (64, 128)  # the head sizes tested on an H100 (test_prefill_attention_gluon.py)
HALF = 64  # query rows per consumer warpgroup (one 64-row warpgroup MMA)
BLOCK_N = 128  # keys per K/V block
# Two query buffers and two K/V stages fill 192 KiB of shared memory; with the output stored
# through the query buffer, they beat one buffer and three stages (224 KiB) at every shape
# of issue 21 on an H100, and with them 10 MiB of K/V per group of tiles beat 16 MiB
# (bench/results/issue21-H100-2026-11-28c/).
Q_BUFFERS, STAGES, L2_BYTES = 2, 2, 10 << 20
CONSUMER_REGS, LOADER_REGS, MAX_REGS = 240, 24, 168  # per thread: 2 x 128 x 240 + 128 x 24 fit


def gluon_prefill_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     max_prefix_len: int | None, capability: tuple[int, int] | None = None) -> bool:
    """Whether this kernel takes the batch: an NVIDIA Hopper GPU (compute capability 9.x:
    `capability`, else q's device's, unless KVPILOT_GLUON_PREFILL=0; a CPU tensor never; never
    under ROCm, whose 9.x is AMD's), 16-bit q/k/v with a tested head size, no sequence with a
    cached prefix (`max_prefix_len` 0; None: unknown), heads contiguous in a token and 16-byte
    aligned rows (TMA), and no CUDA-graph capture under way (untested there)."""
    if torch.version.hip is not None:  # ROCm reports its GPUs as 9.x too (MI300X: 9.4)
        return False
    if capability is None:
        if not (ENABLED and q.is_cuda):
            return False
        capability = torch.cuda.get_device_capability(q.device)
    return (capability[0] == 9 and max_prefix_len == 0
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
            and q.shape[2] in HEAD_DIMS and tma_rows_ok(q, k, v)
            and not (q.is_cuda and torch.cuda.is_current_stream_capturing()))


@dataclass(frozen=True)
class PrefixedKV:
    """Keys and values of sequences with a cached prefix, each sequence's rows contiguous:
    rows kv_starts[b] to kv_starts[b] + seq_lens[b] hold its cached prefix, then its new
    tokens."""
    k: torch.Tensor  # [rows, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_starts: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    max_seq_len: int


def gather_prefixed_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc_cpu: list[int], seq_lens_cpu: list[int]) -> PrefixedKV:
    """Gives the batch's keys and values with each cached prefix copied out of the paged cache
    ([2, num_blocks, block_size, num_kv_heads, head_dim], 16-bit) and the new tokens' rows of
    k, v after it. Sequence b's new tokens are rows query_start_loc_cpu[b] to [b + 1] of k, v
    (a host copy of the launch's query_start_loc: no device sync), its length seq_lens_cpu[b].
    Its region is its prefix blocks' slots plus its new tokens, whole blocks copied, then the
    new rows written over the last block's tail; the slots after its last key are zeroed (the
    kernel masks those keys, but a NaN there would still reach the output through a zero
    weight)."""
    block_size = kv_cache.shape[2]
    regions = []  # (first row, prefix blocks, first new row in k/v, new rows, sequence length)
    rows = 0
    for b, n in enumerate(seq_lens_cpu):
        q0, q_len = query_start_loc_cpu[b], query_start_loc_cpu[b + 1] - query_start_loc_cpu[b]
        blocks = -(-(n - q_len) // block_size)
        regions.append((rows, blocks, q0, q_len, n))
        rows += blocks * block_size + q_len
    shape = (rows, *kv_cache.shape[3:])
    gathered = []
    for cache, new in zip(kv_cache, (k, v), strict=True):
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        for b, (start, blocks, q0, q_len, n) in enumerate(regions):
            if blocks:
                torch.index_select(cache, 0, block_tables[b, :blocks], out=out[
                    start:start + blocks * block_size].view(blocks, block_size, *shape[1:]))
            out[start + n - q_len:start + n].copy_(new[q0:q0 + q_len])
            out[start + n:start + blocks * block_size + q_len].zero_()
        gathered.append(out)
    kv_starts = torch.tensor([region[0] for region in regions], dtype=torch.int32)
    if kv_cache.is_cuda:  # (pinned: the copy queues behind the step's work, no host wait)
        kv_starts = kv_starts.pin_memory().to(kv_cache.device, non_blocking=True)
    return PrefixedKV(gathered[0], gathered[1], kv_starts, seq_lens, max(seq_lens_cpu))


# (a Gluon function reads a module global only as a constexpr)
_HALF, _BLOCK_N = gl.constexpr(HALF), gl.constexpr(BLOCK_N)
_CONSUMER_REGS, _LOADER_REGS = gl.constexpr(CONSUMER_REGS), gl.constexpr(LOADER_REGS)


@_jit
def _barriers(n: gl.constexpr, count: gl.constexpr):
    """Gives `n` mbarriers, each completing a phase after `count` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@_jit
def _tile(t, sched, BLOCK_M: gl.constexpr):
    """Gives tile t's (head, first query row, sequence's first query token, its query length,
    K/V blocks, the sequence's first key row, its cached prefix length): (sequence, head)
    pairs in groups of `group`, each group's longest tiles first; no blocks for a tile past
    its sequence's end. Without PREFIX a sequence's keys are its query rows; with it they
    start at kvs_ptr[seq] and hold seq_lens[seq] - query length cached keys first."""
    qsl_ptr, kvs_ptr, seq_lens_ptr, num_heads, num_seqs, num_m, group, PREFIX = sched
    g = t // (group * num_m)
    r = t - g * group * num_m
    size = gl.minimum(group, num_heads * num_seqs - g * group)  # the last group is short
    pair = g * group + r % size
    head = pair % num_heads
    seq = pair // num_heads
    m0 = (num_m - 1 - r // size) * BLOCK_M
    q_start = gl.load(qsl_ptr + seq)
    q_len = gl.load(qsl_ptr + seq + 1) - q_start
    if PREFIX:
        kv_start = gl.load(kvs_ptr + seq)
        prefix = gl.load(seq_lens_ptr + seq) - q_len
    else:
        kv_start = q_start
        prefix = q_len * 0
    n_blocks = gl.where(m0 < q_len,
                        (prefix + gl.minimum(m0 + BLOCK_M, q_len) + _BLOCK_N - 1) // _BLOCK_N, 0)
    return head, m0, q_start, q_len, n_blocks, kv_start, prefix


@_jit
def _load_partition(descs, bufs, bars, sched, out, GROUP: gl.constexpr,
                    HEAD_DIM: gl.constexpr):
    """The loader warp: each tile's two query halves, then its K/V blocks into the ring."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = bufs
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bars
    num_stages: gl.constexpr = k_smem.type.shape[0]
    q_buffers: gl.constexpr = q_smem.type.shape[0] // 2
    num_tiles = sched[3] * sched[4] * sched[5]
    c = 0  # K/V blocks loaded, over all of this program's tiles
    qi = 0  # tiles with work
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        head, m0, q_start, _, n_blocks, kv_start, _ = _tile(t, sched, 2 * _HALF)
        if n_blocks > 0:
            b = qi % q_buffers
            mbarrier.wait(q_empty.index(b), ((qi // q_buffers) & 1) ^ 1)
            mbarrier.expect(q_ready.index(b), 2 * q_desc.block_type.nbytes)
            for w in gl.static_range(2):
                _tma_load(q_desc, [q_start + m0 + w * _HALF, head * HEAD_DIM], q_ready.index(b),
                          q_smem.index(2 * b + w))
            kv_col = (head // GROUP) * HEAD_DIM
            for j in range(n_blocks):
                s = c % num_stages
                ph = ((c // num_stages) & 1) ^ 1
                mbarrier.wait(k_empty.index(s), ph)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                _tma_load(k_desc, [kv_start + j * _BLOCK_N, kv_col], k_ready.index(s),
                          k_smem.index(s))
                mbarrier.wait(v_empty.index(s), ph)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                _tma_load(v_desc, [kv_start + j * _BLOCK_N, kv_col], v_ready.index(s),
                          v_smem.index(s))
                c += 1
            qi += 1


@_jit
def _softmax(s, m_i, l_i, rows, cols, qk_scale, MASK: gl.constexpr):
    """One online-softmax step over a block of scores (base-2, the scale in the FMA)."""
    if MASK:
        s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@_jit
def _scores(s, m_i, l_i, rows, cols, j, row0, qk_scale):
    """`_softmax` of block j, masked where the block reaches right of the first row."""
    if (j + 1) * _BLOCK_N - 1 > row0:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, rows, cols + j * _BLOCK_N, qk_scale, True)
    else:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, rows, cols, qk_scale, False)
    return p, alpha, m_i, l_i


@_jit
def _consume(bufs, bars, sched, out, W: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Consumer warpgroup W: query rows W * 64 to W * 64 + 63 of each tile."""
    q_smem, k_smem, v_smem = bufs
    q_ready, q_empty, k_ready, v_ready, k_empty, v_empty = bars
    out_ptr, o_desc, stride_ot, stride_oh, qk_scale, TMA_STORE = out
    num_stages: gl.constexpr = k_smem.type.shape[0]
    q_buffers: gl.constexpr = q_smem.type.shape[0] // 2
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([_HALF, _BLOCK_N], gl.float32, layout=s_layout)
    num_tiles = sched[3] * sched[4] * sched[5]
    c = 0
    qi = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        head, m0, q_start, q_len, n_blocks, _, prefix = _tile(t, sched, 2 * _HALF)
        if n_blocks > 0:
            b = qi % q_buffers
            row0 = m0 + W * _HALF
            diag0 = prefix + row0  # the first row's position among the sequence's keys
            rows = diag0 + gl.arange(0, _HALF, layout=row_layout)
            cols = gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            m_i = gl.full([_HALF], float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.full([_HALF], 0.0, gl.float32, layout=row_layout)
            acc = gl.zeros([_HALF, HEAD_DIM], gl.float32, layout=o_layout)
            q = q_smem.index(2 * b + W)
            mbarrier.wait(q_ready.index(b), (qi // q_buffers) & 1)
            # block 0: its scores and softmax, nothing to overlap with yet
            st = c % num_stages
            mbarrier.wait(k_ready.index(st), (c // num_stages) & 1)
            s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(st), count=1)
            p, alpha, m_i, l_i = _scores(s, m_i, l_i, rows, cols, 0, diag0, qk_scale)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            for j in range(1, n_blocks):
                # block j's scores and block j-1's P @ V run while block j's softmax does
                prev = c % num_stages
                prev_phase = (c // num_stages) & 1
                c += 1
                st = c % num_stages
                mbarrier.wait(k_ready.index(st), (c // num_stages) & 1)
                s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                mbarrier.wait(v_ready.index(prev), prev_phase)
                acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s,))
                mbarrier.arrive(k_empty.index(st), count=1)
                p, alpha, m_i, l_i = _scores(s, m_i, l_i, rows, cols, j, diag0, qk_scale)
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
                mbarrier.arrive(v_empty.index(prev), count=1)
                acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
            st = c % num_stages
            mbarrier.wait(v_ready.index(st), (c // num_stages) & 1)
            acc = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, p_op))[0]
            mbarrier.arrive(v_empty.index(st), count=1)
            c += 1
            qi += 1
            o = (acc / gl.convert_layout(l_i, o_row_layout)[:, None]).to(dtype)
            if TMA_STORE and row0 + _HALF <= q_len:
                # a whole half-tile leaves through its query buffer, free since the tile's last
                # scores: one TMA store of full rows, done reading before the loader refills it
                q.store(o)
                fence_async_shared()
                _tma_store(o_desc, [q_start + row0, head * HEAD_DIM], q)
                tma.store_wait(0)
            else:  # rows past the sequence's end belong to the next one: a masked store
                o_rows = row0 + gl.arange(0, _HALF, layout=o_row_layout)
                o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                ptrs = out_ptr + (q_start + o_rows).to(gl.int64)[:, None] * stride_ot \
                    + head * stride_oh + o_cols[None, :]
                gl.store(ptrs, o, mask=(o_rows < q_len)[:, None])
            mbarrier.arrive(q_empty.index(b), count=1)


# the worker partitions share one signature (Gluon's rule): the second consumer and the
# loader take the same arguments
@_jit
def _consume_second(descs, bufs, bars, sched, out, GROUP: gl.constexpr,
                    HEAD_DIM: gl.constexpr):
    _consume(bufs, bars, sched, out, 1, HEAD_DIM)


# the batch's sizes change every step and the sequence offsets are a slice past the decode
# rows: no specialisation on them, or each new value class is a fresh compile mid-serving.
# The output's strides stay specialised (a model's, fixed): divisible by 16 they let each
# thread store its two adjacent columns at once (st.global.b32, 64 stores a tile row block
# instead of 128 b16 ones); unspecialised, the kernel ran at 0.83-0.96x the fastest SDPA
# backend on an H100, specialised at 0.95-1.04x (bench/results/issue21-H100-2026-11-28/)
@_jit(do_not_specialize=["num_seqs", "num_m", "group"],
      do_not_specialize_on_alignment=["qsl_ptr", "kvs_ptr", "seq_lens_ptr"])
def _prefill_kernel(q_desc, k_desc, v_desc, qsl_ptr, kvs_ptr, seq_lens_ptr, out_ptr, o_desc,
                    stride_ot, stride_oh, qk_scale, num_heads, num_seqs, num_m, group,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                    Q_BUFS: gl.constexpr, TMA_STORE: gl.constexpr, PREFIX: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, _HALF, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, _BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, _BLOCK_N, HEAD_DIM], v_desc.layout)
    # (q_ready, q_empty, k_ready, v_ready, k_empty, v_empty): a buffer is ready once its
    # TMA load lands, and empty once both consumer warpgroups are done with it
    bars = (_barriers(Q_BUFS, 1), _barriers(Q_BUFS, 2), _barriers(NUM_STAGES, 1),
            _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, 2), _barriers(NUM_STAGES, 2))
    descs = (q_desc, k_desc, v_desc)
    bufs = (q_smem, k_smem, v_smem)
    sched = (qsl_ptr, kvs_ptr, seq_lens_ptr, num_heads, num_seqs, num_m, group, PREFIX)
    out = (out_ptr, o_desc, stride_ot, stride_oh, qk_scale, TMA_STORE)
    gl.warp_specialize([
        (_consume, (bufs, bars, sched, out, 0, HEAD_DIM)),
        (_consume_second, (descs, bufs, bars, sched, out, GROUP, HEAD_DIM)),
        (_load_partition, (descs, bufs, bars, sched, out, GROUP, HEAD_DIM)),
    ], [4, 1], [_CONSUMER_REGS, _LOADER_REGS])


@functools.cache
def _num_sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _smem_layouts(head_dim: int, dtype: torch.dtype) -> tuple[gl.NVMMASharedLayout, ...]:
    """The swizzled shared-memory layouts of a query half-tile and a K/V block (computed once
    per head size and dtype, not per launch)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (gl.NVMMASharedLayout.get_default_for([HALF, head_dim], element),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], element))


def gluon_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                            out: torch.Tensor | None = None, q_buffers: int = Q_BUFFERS,
                            stages: int = STAGES, l2_bytes: int = L2_BYTES,
                            programs: int | None = None,
                            prefixed: PrefixedKV | None = None) -> torch.Tensor:
    """Gives the causal attention output [T, num_heads, head_dim] of a batch of sequences
    (`gluon_prefill_ok` must hold, prefixes aside). Without `prefixed` no sequence has a
    cached prefix and k, v are the new tokens' rows beside q's; with it, k and v hold each
    sequence's keys from its first (`gather_prefixed_kv`). `q_buffers`, `stages`, `l2_bytes`
    and `programs` (default: one per SM) are the benchmark's and the tests' knobs."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    if out is None:
        out = torch.empty_like(q)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs == 0 or max_query_len == 0:
        return out
    assert out.stride(2) == 1, "out's head_dim must be dense"
    q_layout, kv_layout = _smem_layouts(head_dim, q.dtype)

    def descriptor(x: torch.Tensor, rows: int, layout) -> TensorDescriptor:
        flat = x.view(x.shape[0], x.shape[1] * head_dim)  # heads contiguous: a 2-D row a token
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, head_dim],
                                layout)

    num_m = triton.cdiv(max_query_len, 2 * HALF)
    # (sequence, head) pairs per group: as many as have l2_bytes of K/V between them (the
    # GQA group's heads share theirs)
    max_kv_len = prefixed.max_seq_len if prefixed is not None else max_query_len
    kv_bytes_per_head = 2 * max_kv_len * head_dim * q.element_size() * num_kv_heads / num_heads
    group = max(1, min(num_heads * num_seqs, int(l2_bytes // kv_bytes_per_head)))
    tiles = num_heads * num_seqs * num_m
    grid = (min(tiles, programs or _num_sms(q.device.index or 0)),)
    q_desc = descriptor(q, HALF, q_layout)
    # the output leaves by TMA where its rows allow a descriptor (else q's stands in, unread)
    tma_store = tma_rows_ok(out)
    # without a prefix the key starts and lengths are query_start_loc's, never read
    kv_starts = prefixed.kv_starts if prefixed is not None else query_start_loc
    seq_lens = prefixed.seq_lens if prefixed is not None else query_start_loc
    _prefill_kernel[grid](
        q_desc, descriptor(k, BLOCK_N, kv_layout), descriptor(v, BLOCK_N, kv_layout),
        query_start_loc, kv_starts, seq_lens, out,
        descriptor(out, HALF, q_layout) if tma_store else q_desc,
        out.stride(0), out.stride(1), scale * LOG2E, num_heads, num_seqs, num_m, group,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, NUM_STAGES=stages, Q_BUFS=q_buffers,
        TMA_STORE=tma_store, PREFIX=prefixed is not None, num_warps=4, maxnreg=MAX_REGS)
    return out
