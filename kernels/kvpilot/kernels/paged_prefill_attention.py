"""Paged prefill (extend) attention: a variable-length batch of new tokens, causal.

The batch is the flat layout of ``engine/attention/metadata.py``: sequence ``b``
owns query rows ``query_start_loc[b]:query_start_loc[b+1]``, which are its last
``query_len`` positions; its first ``seq_len - query_len`` tokens (the cached
prefix) already sit in the paged cache.

One program takes ``BLOCK_M`` query rows of one head of one sequence and runs
the flash-attention loop twice: first over the cached prefix, gathered from
the paged cache (every query row sees all of it), then over the new tokens'
own K/V, read contiguously from the step's ``k``/``v`` (the causal part: full
tiles left of the diagonal unmasked, the diagonal tile masked). Reading new
K/V from the step's tensors rather than the cache keeps the common no-prefix
case on dense, coalesced loads. An fp8 (E4M3) cache is widened and scaled by its
per-layer scale right after each load; the new tokens' K/V stay in the model dtype.

On Hopper and later (`use_tma`), a second kernel reads the new tokens' Q/K/V through
TMA tensor descriptors made on the device (2-D views [tokens, heads * head_dim] of the
step's tensors). (Triton 3.6's warp specialisation of its K/V loop was tried on an H100:
no faster, most tile configurations failed to compile, and one fp32 GPU test case gave
wrong output; bench/results/attention-H100-2026-11-27-tma/.) A descriptor's tile can run past a sequence's last
token into the next sequence's rows (or past the tensor's end, which reads zeros): those
columns are masked like the pointer kernel's, and rows past the sequence are never
stored. The cached prefix is read by the same gathering loop as the pointer kernel.

A batch whose sequences have no cached prefix goes, on Hopper, to a third kernel written in
Gluon (`prefill_attention_gluon`: warp-specialised, persistent, FlashAttention-3's layout),
when the caller says so through `max_prefix_len=0`: the launcher cannot see the lengths
without a device sync.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from kvpilot.kernels.jit import jit
from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE, cached_rows
from kvpilot.kernels.tma_rows import tma_rows_ok

try:  # Gluon's Hopper API (Triton 3.6 on); with an older Triton the Triton kernels serve all
    from kvpilot.kernels import prefill_attention_gluon as _gluon
except (ImportError, AttributeError):  # pragma: no cover
    _gluon = None
# the fewest new tokens a sequence with a cached prefix needs to run on the Gluon kernel
GATHER_MIN_QUERY = _gluon.GATHER_MIN_QUERY if _gluon is not None else 128

LOG2E = 1.4426950408889634


@jit
def _tile(acc, m_i, l_i, q, k, v, qk_scale, mask):
    """Gives (acc, m_i, l_i) after one online-softmax step over a K/V tile (base-2 exps)."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@jit
def _tile_fma(acc, m_i, l_i, q, k, v, qk_scale, mask, MASKED: tl.constexpr):
    """`_tile` with the scale folded into the exponent's argument (one FMA per score, the
    row max taken before scaling) and P @ V accumulated into `acc` by the MMA itself."""
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@jit
def _program(query_start_loc_ptr):
    """Gives this program's (head, query tile, sequence, first query row, query length); the
    grid is (heads, query tiles, sequences), the longest (most masked-in) tiles first for a
    better tail balance of causal work."""
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    return tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1), seq, q_start, q_len


@jit
def load_paged_kv(k_base, table, pos, end, offs_d, stride_kv, stride_slot, k_scale, v_scale,
                  like, BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):
    """Gives the K and V rows [BLOCK_N, HEAD_DIM] of a sequence's positions `pos` (zeros from
    `end` on), gathered through its block `table` from the paged cache (`k_base`: its K rows
    of one KV head; V sits `stride_kv` further), an fp8 cache widened and scaled, in the
    dtype of `like`."""
    valid = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = slot[:, None] * stride_slot + offs_d[None, :]
    k = tl.load(k_base + kv_off, mask=valid[:, None], other=0.0)
    v = tl.load(k_base + stride_kv + kv_off, mask=valid[:, None], other=0.0)
    if KV_FP8:
        k = (k.to(tl.float32) * k_scale).to(like.dtype)
        v = (v.to(tl.float32) * v_scale).to(like.dtype)
    return k, v


@jit
def _cached_prefix(q, qk_scale, k_base, table, ctx_len, stride_kv, stride_slot, k_scale,
                   v_scale, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
                   FMA: tl.constexpr):
    """Gives the online softmax's (acc, m_i, l_i) for the BLOCK_M query rows `q` after a
    sequence's `ctx_len` cached tokens (none: the empty state), gathered BLOCK_N at a time
    through its block `table` from the paged cache (`k_base`: its K rows of this KV head; V
    sits `stride_kv` further); `_tile_fma`'s step where FMA, else `_tile`'s."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(0, ctx_len, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < ctx_len
        k, v = load_paged_kv(k_base, table, pos, ctx_len, offs_d, stride_kv, stride_slot,
                             k_scale, v_scale, q, BLOCK_SIZE, KV_FP8)
        if FMA:
            acc, m_i, l_i = _tile_fma(acc, m_i, l_i, q, k, v, qk_scale, valid[None, :], True)
        else:
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, k, v, qk_scale, valid[None, :])
    return acc, m_i, l_i


# the block table's width and the sliced per-sequence tensors change every step: no
# specialisation on them, or each new width/alignment is a fresh compile mid-serving
@jit(do_not_specialize=["stride_bt"],
     do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kv, stride_slot, stride_bt, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
):
    head, start_m, seq, q_start, q_len = _program(query_start_loc_ptr)
    if start_m * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < q_len
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
                + offs_d[None, :], mask=row_mask[:, None], other=0.0)

    # 1) the cached prefix, gathered block by block from the paged cache
    acc, m_i, l_i = _cached_prefix(
        q, qk_scale, cache_ptr + kv_head * HEAD_DIM, block_tables_ptr + seq * stride_bt,
        ctx_len, stride_kv, stride_slot, k_scale, v_scale,
        HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, KV_FP8, False)

    # 2) the new tokens: tiles fully left of the diagonal need no mask
    k_new = k_ptr + q_start * stride_kt + kv_head * stride_kh
    v_new = v_ptr + q_start * stride_vt + kv_head * stride_vh
    for n0 in range(0, start_m * BLOCK_M, BLOCK_N):
        rows = (n0 + offs_n)[:, None]
        k = tl.load(k_new + rows * stride_kt + offs_d[None, :])
        v = tl.load(v_new + rows * stride_vt + offs_d[None, :])
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, k, v, qk_scale, True)
    diag_end = tl.minimum((start_m + 1) * BLOCK_M, q_len)
    for n0 in range(start_m * BLOCK_M, diag_end, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < q_len
        k = tl.load(k_new + cols[:, None] * stride_kt + offs_d[None, :], mask=col_ok[:, None],
                    other=0.0)
        v = tl.load(v_new + cols[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None],
                    other=0.0)
        mask = col_ok[None, :] & (cols[None, :] <= offs_m[:, None])
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, k, v, qk_scale, mask)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@jit(do_not_specialize=["stride_bt", "num_tokens"],
     do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel_tma(
    q_ptr, k_ptr, v_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, qk_scale, num_tokens,
    stride_qt, stride_kt, stride_vt, stride_ot, stride_oh,
    stride_kv, stride_slot, stride_bt, k_scale, v_scale,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    head, start_m, seq, q_start, q_len = _program(query_start_loc_ptr)
    if start_m * BLOCK_M >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq) - q_len
    kv_head = head // GROUP
    num_kv_heads: tl.constexpr = NUM_HEADS // GROUP
    # (triton's annotations type shape/strides as tensors; ints and constexprs are what it takes)
    q_width, kv_width = NUM_HEADS * HEAD_DIM, num_kv_heads * HEAD_DIM
    desc_q = tl.make_tensor_descriptor(
        q_ptr, shape=[num_tokens, q_width], strides=[stride_qt, 1],  # pyright: ignore[reportArgumentType]
        block_shape=[BLOCK_M, HEAD_DIM])
    desc_k = tl.make_tensor_descriptor(
        k_ptr, shape=[num_tokens, kv_width], strides=[stride_kt, 1],  # pyright: ignore[reportArgumentType]
        block_shape=[BLOCK_N, HEAD_DIM])
    desc_v = tl.make_tensor_descriptor(
        v_ptr, shape=[num_tokens, kv_width], strides=[stride_vt, 1],  # pyright: ignore[reportArgumentType]
        block_shape=[BLOCK_N, HEAD_DIM])

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = desc_q.load([q_start + start_m * BLOCK_M, head * HEAD_DIM])

    # 1) the cached prefix, gathered block by block from the paged cache (as _prefill_kernel)
    acc, m_i, l_i = _cached_prefix(
        q, qk_scale, cache_ptr + kv_head * HEAD_DIM, block_tables_ptr + seq * stride_bt,
        ctx_len, stride_kv, stride_slot, k_scale, v_scale,
        HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, KV_FP8, True)

    # 2) the new tokens through the descriptors: whole tiles left of the diagonal unmasked
    for n0 in range(0, start_m * BLOCK_M, BLOCK_N):
        k = desc_k.load([q_start + n0, kv_head * HEAD_DIM])
        v = desc_v.load([q_start + n0, kv_head * HEAD_DIM])
        acc, m_i, l_i = _tile_fma(acc, m_i, l_i, q, k, v, qk_scale, True, False)
    diag_end = tl.minimum((start_m + 1) * BLOCK_M, q_len)
    for n0 in range(start_m * BLOCK_M, diag_end, BLOCK_N):
        cols = n0 + offs_n
        k = desc_k.load([q_start + n0, kv_head * HEAD_DIM])
        v = desc_v.load([q_start + n0, kv_head * HEAD_DIM])
        # columns past q_len (the next sequence's rows, or zeros) are right of every stored
        # row's diagonal: masked by causality alone
        mask = cols[None, :] <= offs_m[:, None]
        acc, m_i, l_i = _tile_fma(acc, m_i, l_i, q, k, v, qk_scale, mask, True)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(offs_m < q_len)[:, None])


def default_tiles(head_dim: int, elem_size: int = 2, tma: bool = False
                  ) -> tuple[int, int, int, int]:
    """Gives (block_m, block_n, num_warps, num_stages) that fit 228 KB of shared memory.

    Keyed by the bytes of one K row; the bf16 head_dim-128 entries are the best of the
    H100 sweeps in bench/results/ (attention.json for the pointer kernel, the -tma run for
    the TMA kernel: 128-wide K/V tiles, 3 stages, 8 warps).
    """
    row_bytes = head_dim * elem_size
    if tma and row_bytes == 256:
        return 128, 128, 8, 3
    if row_bytes <= 128:
        return 128, 64, 4, 3
    if row_bytes <= 256:
        return 128, 64, 8, 4
    if row_bytes <= 512:
        return 64, 32, 4, 2
    return 32, 32, 4, 2


# whether the launcher takes the TMA kernel where it can: on an H100 it gave 0.80 / 0.85 /
# 0.76 of cuDNN attention at issue 21's three shapes against the pointer kernel's 0.75 /
# 0.77 / 0.74 in the same call (bench/results/attention-H100-2026-11-27-tma/); the pointer
# kernel serves every other case
TMA_BY_DEFAULT = True


def tma_layout_ok(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether the TMA kernel can read `q`, `k`, `v`: an NVIDIA GPU of compute capability 9.0
    or newer (never under ROCm, whose torch reports an MI300X as 9.4: the kernel's tensor
    descriptors have not run on AMD GPUs) and `tma_rows_ok` (heads contiguous within a token,
    16-byte aligned rows)."""
    if torch.version.hip is not None:
        return False
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9:
        return False  # (CPU tensors reach a kernel only under Triton's interpreter)
    return tma_rows_ok(q, *kv)


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors the TMA kernel makes on the device (triton's allocator
    protocol; the tensor lives as long as the launch needs it)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _gluon_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 max_prefix_len: int | None) -> bool:
    """Whether the Gluon kernel is importable and `gluon_prefill_ok` holds for the batch."""
    return _gluon is not None and _gluon.gluon_prefill_ok(q, k, v, max_prefix_len)


def _gluon_gathers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   query_start_loc_cpu: list[int] | None, seq_lens_cpu: list[int] | None
                   ) -> bool:
    """Whether a batch with cached prefixes runs on the Gluon kernel, its keys gathered first
    (`prefill_attention_gluon.gather_prefixed_kv`): the kernel takes the batch but for its
    prefixes, the cache holds q's dtype (not fp8), the host knows the lengths, every sequence
    has at least GATHER_MIN_QUERY new tokens and the gathered keys fit GATHER_MAX_BYTES."""
    if _gluon is None or not _gluon.GATHER_PREFIX or not _gluon_takes(q, k, v, 0) \
            or kv_cache.dtype != q.dtype or query_start_loc_cpu is None or seq_lens_cpu is None:
        return False
    if min(b - a for a, b in itertools.pairwise(query_start_loc_cpu)) < GATHER_MIN_QUERY:
        return False
    block_size, row_bytes = kv_cache.shape[2], kv_cache[0, 0, 0].numel() * q.element_size()
    rows = sum(-(-n // block_size) * block_size + block_size for n in seq_lens_cpu)
    return 2 * rows * row_bytes <= _gluon.GATHER_MAX_BYTES


def gather_reserve_bytes(device: torch.device, kv_dtype: torch.dtype, kv_bytes_per_token: int,
                         max_tokens: int) -> int:
    """Gives the GPU memory an engine keeps beside its KV cache for one layer's keys and values
    gathered for the Gluon kernel (freed after each layer): `kv_bytes_per_token` (one layer,
    K and V) times `max_tokens` (every sequence's tokens, the most a step's prefixed sequences
    hold), at most GATHER_MAX_BYTES; 0 where no prefix is ever gathered (not a Hopper GPU
    under CUDA, an fp8 cache, Gluon off or missing)."""
    if _gluon is None or not (_gluon.ENABLED and _gluon.GATHER_PREFIX) \
            or torch.version.hip is not None or device.type != "cuda" \
            or kv_dtype not in (torch.float16, torch.bfloat16) \
            or torch.cuda.get_device_capability(device)[0] != 9:
        return 0
    return min(_gluon.GATHER_MAX_BYTES, kv_bytes_per_token * max_tokens)


def no_prefix_kernel_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Gives whether `paged_prefill_attention` takes a batch of these q/k/v with no cached
    prefix (`max_prefix_len=0`) through the Gluon kernel: a caller with sequences of both
    kinds then gains by launching the ones without a prefix as a batch of their own."""
    return _gluon_takes(q, k, v, 0)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], the step's new keys
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # (k, v) dequantisation scales of an fp8 cache
    use_tma: bool | None = None,  # None: where tma_layout_ok says the descriptors can be made
    max_prefix_len: int | None = None,  # the longest cached prefix in the batch (None: unknown)
    use_gluon: bool | None = None,  # None: where gluon_prefill_ok says the Gluon kernel runs
    query_start_loc_cpu: list[int] | None = None,  # host copies of query_start_loc and
    seq_lens_cpu: list[int] | None = None,  # seq_lens: let prefixed batches take Gluon
) -> torch.Tensor:
    """Gives the causal attention output [T, num_heads, head_dim] of every new token.

    On Hopper the warp-specialised Gluon kernel of `prefill_attention_gluon` runs a batch
    with no cached prefix (`max_prefix_len` 0) where `gluon_prefill_ok` holds, and a batch
    with prefixes whose lengths the host copies give, where `_gluon_gathers` holds, on keys
    gathered from the cache; the tile and TMA arguments are then unused."""
    gluon = _gluon if _gluon_takes(q, k, v, max_prefix_len) else None
    prefixed = None
    if gluon is None and use_gluon is not False and _gluon_gathers(
            q, k, v, kv_cache, query_start_loc_cpu, seq_lens_cpu):
        assert _gluon is not None and query_start_loc_cpu is not None and seq_lens_cpu is not None
        gluon = _gluon
        prefixed = gluon.gather_prefixed_kv(k, v, kv_cache, block_tables, seq_lens,
                                            query_start_loc_cpu, seq_lens_cpu)
    if use_gluon and gluon is None:
        raise ValueError("use_gluon: needs Triton 3.6+ (Gluon), a Hopper GPU (compute capability "
                         "9.x), KVPILOT_GLUON_PREFILL not 0, fp16/bf16 q/k/v with head_dim 64 "
                         "or 128 whose heads are contiguous within a token (16-byte aligned "
                         "rows), no CUDA-graph capture, and no cached prefix (max_prefix_len=0) "
                         "unless the host's lengths are given (query_start_loc_cpu, "
                         "seq_lens_cpu), the cache is 16-bit and every sequence has 128 or "
                         "more new tokens")
    if gluon is not None and use_gluon is not False:
        if prefixed is not None:
            return gluon.gluon_prefill_attention(q, prefixed.k, prefixed.v, query_start_loc,
                                                 max_query_len, scale, out=out,
                                                 prefixed=prefixed)
        return gluon.gluon_prefill_attention(q, k, v, query_start_loc, max_query_len, scale,
                                             out=out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    if use_tma is None:
        # not under CUDA-graph capture: the descriptors' scratch is freed after the launch
        use_tma = TMA_BY_DEFAULT and q.is_cuda and tma_layout_ok(q, k, v) \
            and not torch.cuda.is_current_stream_capturing()
    elif use_tma and not tma_layout_ok(q, k, v):
        raise ValueError("use_tma: needs an NVIDIA GPU (not ROCm) of compute capability 9.0 or "
                         "newer and q/k/v whose heads are contiguous within a token, with 16-byte "
                         "aligned token strides and base addresses")
    tiles = default_tiles(head_dim, q.element_size(), use_tma)
    block_m, block_n = block_m or tiles[0], block_n or tiles[1]
    num_warps, num_stages = num_warps or tiles[2], num_stages or tiles[3]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head_dim must be dense in q, k, v"
    # the diagonal split needs whole K tiles per query tile
    assert block_m % block_n == 0, f"block_m={block_m} must be a multiple of block_n={block_n}"
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (num_heads, triton.cdiv(max_query_len, block_m), num_seqs)
    if use_tma:
        triton.set_allocator(_descriptor_scratch)  # a ContextVar: set in the launching thread
        _prefill_kernel_tma[grid](
            q, k, v, kv_cache, block_tables, query_start_loc, seq_lens, out, scale * LOG2E,
            q.shape[0], q.stride(0), k.stride(0), v.stride(0), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(2), block_tables.stride(0), *kv_scales,
            NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
            KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
            num_warps=num_warps, num_stages=num_stages,
        )
        return out
    _prefill_kernel[grid](
        q, k, v, kv_cache, block_tables, query_start_loc, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), block_tables.stride(0), *kv_scales,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Gives the same output in float32 with plain torch: prefix from the cache, then new K/V."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, ctx = q1 - q0, int(seq_lens[b]) - (q1 - q0)
        if q_len == 0:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = torch.cat([cached_rows(kv_cache[0], slots, kv_scales[0]), k[q0:q1].float()])
        vals = torch.cat([cached_rows(kv_cache[1], slots, kv_scales[1]), v[q0:q1].float()])
        keys, vals = keys.repeat_interleave(group, dim=1), vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", q[q0:q1].float(), keys) * scale
        causal = torch.arange(ctx + q_len, device=q.device)[None, :] <= (
            ctx + torch.arange(q_len, device=q.device))[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[q0:q1] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), vals)
    return out.to(q.dtype)
