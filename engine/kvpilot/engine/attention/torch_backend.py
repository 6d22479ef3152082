"""The torch reference attention backend: paged KV writes and per-sequence SDPA.

Correct on any device and reasonably quick on CPU: decode rows (query_len 1) go
through a few padded SDPA calls, sequences of similar length together; each prefill chunk gets its own
call with an explicit causal mask offset by the tokens already cached. The index
tensors of a step are built once and reused by every layer. Cache rows are moved as
bytes (CPU torch cannot index fp8 tensors) and an fp8 cache's are dequantised with
the layer's scales after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch.nn import functional as F

from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.kernels.kv_cache_dtype import as_bytes, from_cache_dtype, to_cache_dtype


@dataclass
class _DecodeGroup:
    """Decode sequences of similar length, attended in one padded call."""

    rows: torch.Tensor  # [D] their query rows
    blocks: torch.Tensor  # [D * padded_blocks] cache blocks to gather
    pad_rows: torch.Tensor  # gathered token rows past each seq_len
    mask: torch.Tensor  # [D, 1, 1, padded_len] True where a key is real


@dataclass
class _StepPlan:
    """What one step's layers share: decode groups, prefill chunks and their lengths."""

    decode_groups: list[_DecodeGroup]
    prefills: list[tuple[int, int, int]]  # (sequence, first query row, query_len)
    seq_lens: list[int]


class TorchAttentionBackend:
    """Implements `AttentionBackend` with plain torch ops."""

    def __init__(self) -> None:
        self._plan: tuple[AttentionMetadata, _StepPlan] | None = None
        # Reused gather buffers: a fresh multi-MB tensor per layer costs page faults on CPU.
        self._buffers: dict[str, torch.Tensor] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0),
                kv_written: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gives the attention output [T, num_heads, head_dim] (in `out` when given) after
        caching this step's k, v (unless the caller has: `kv_written`)."""
        if not kv_written:
            write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scales)
        plan = self._plan_for(meta, kv_cache.shape[2])
        if out is None:
            out = torch.empty_like(q)
        for group in plan.decode_groups:
            out[group.rows] = self._decode(q[group.rows], kv_cache, group, scale, kv_scales)
        for seq, start, num_q in plan.prefills:
            rows = slice(start, start + num_q)
            seq_len = plan.seq_lens[seq]
            if num_q == seq_len:  # nothing cached before this chunk: use k, v as they are
                ctx_k, ctx_v = k[rows], v[rows]
            else:  # the cached prefix from the cache, this chunk's own k, v as they are
                ctx_k, ctx_v = gather_context(kv_cache, meta.block_tables[seq], seq_len - num_q)
                ctx_k = torch.cat([from_cache_dtype(ctx_k, q.dtype, kv_scales[0]), k[rows]])
                ctx_v = torch.cat([from_cache_dtype(ctx_v, q.dtype, kv_scales[1]), v[rows]])
            out[rows] = _prefill(q[rows], ctx_k, ctx_v, scale)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup,
                scale: float, kv_scales: tuple[float, float]) -> torch.Tensor:
        """Gives attention of D single-token queries [D, heads, d] over their padded contexts."""
        k = from_cache_dtype(self._gather_padded("k", kv_cache[0], group), q.dtype, kv_scales[0])
        v = from_cache_dtype(self._gather_padded("v", kv_cache[1], group), q.dtype, kv_scales[1])
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=group.mask,
                                             scale=scale, enable_gqa=True)
        return out.squeeze(2)

    def _gather_padded(self, name: str, cache: torch.Tensor,
                       group: _DecodeGroup) -> torch.Tensor:
        """Gives [D, kv_heads, padded_len, d]: each decode sequence's blocks side by side.

        Slots past a sequence's end hold whatever the cache had (even NaN), and a masked
        score times a NaN value is still NaN, so they are zeroed.
        """
        blocks, dtype, cache = group.blocks, cache.dtype, as_bytes(cache)
        shape = (blocks.numel(), *cache.shape[1:])
        numel = blocks.numel() * cache[0].numel()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != cache.dtype \
                or buffer.device != cache.device:
            buffer = self._buffers[name] = torch.empty(numel, dtype=cache.dtype,
                                                       device=cache.device)
        rows = torch.index_select(cache, 0, blocks, out=buffer[:numel].view(shape))
        tokens = rows.view(-1, *cache.shape[2:])
        tokens.index_fill_(0, group.pad_rows, 0)
        batch = group.mask.shape[0]
        return tokens.view(batch, -1, *cache.shape[2:]).transpose(1, 2).view(dtype)

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        """Gives the step plan of `meta`, building it on the first layer of the step."""
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, _build_plan(meta, block_size))
        return self._plan[1]


# Decodes sorted by length are split into up to this many groups, so a short sequence is
# not padded to the longest one; more groups cost more calls.
MAX_DECODE_GROUPS = 8
MIN_DECODE_GROUP = 8


def _build_plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    query_lens = meta.query_lens_cpu or meta.query_start_loc.diff().tolist()
    seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    starts = [0, *accumulate(query_lens)]  # first query row of each sequence
    prefills = [(i, starts[i], n) for i, n in enumerate(query_lens) if n > 1]
    decodes = sorted((i for i, n in enumerate(query_lens) if n == 1), key=seq_lens.__getitem__)
    num_groups = min(MAX_DECODE_GROUPS, -(-len(decodes) // MIN_DECODE_GROUP))
    size = max(1, -(-len(decodes) // max(num_groups, 1)))
    groups = [_decode_group(meta, decodes[i:i + size], starts, seq_lens, block_size)
              for i in range(0, len(decodes), size)]
    return _StepPlan(groups, prefills, seq_lens)


def _decode_group(meta: AttentionMetadata, seqs: list[int], starts: list[int],
                  seq_lens: list[int], block_size: int) -> _DecodeGroup:
    device = meta.block_tables.device
    lens = torch.tensor([seq_lens[i] for i in seqs], device=device)
    num_blocks = -(-max(seq_lens[i] for i in seqs) // block_size)
    index = torch.tensor(seqs, device=device)
    blocks = meta.block_tables[index, :num_blocks].long().clamp(min=0)
    valid = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]
    return _DecodeGroup(
        rows=torch.tensor([starts[i] for i in seqs], device=device),
        blocks=blocks.flatten(),
        pad_rows=(~valid).flatten().nonzero().squeeze(1),
        mask=valid[:, None, None, :],
    )


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor,
                   kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Stores k, v [T, kv_heads, d] at their slots (fp8: divided by `kv_scales`); rows with
    slot -1 are not written."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = as_bytes(kv_cache).view(2, num_blocks * block_size, *kv_cache.shape[3:])
    for i, (x, x_scale) in enumerate(((k, kv_scales[0]), (v, kv_scales[1]))):
        flat[i].index_copy_(0, slot_mapping, as_bytes(to_cache_dtype(x, kv_cache.dtype, x_scale)))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor,
                   num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives one sequence's first `num_tokens` cached k and v, each [num_tokens, kv_heads, d],
    in the cache dtype."""
    block_size, dtype = kv_cache.shape[2], kv_cache.dtype
    blocks = block_table[: -(-num_tokens // block_size)].long()
    raw = as_bytes(kv_cache)
    k = raw[0].index_select(0, blocks).flatten(0, 1)[:num_tokens].view(dtype)
    v = raw[1].index_select(0, blocks).flatten(0, 1)[:num_tokens].view(dtype)
    return k, v


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one sequence's Q query rows over its L context rows; row j sees
    positions <= L - Q + j."""
    num_q, seq_len = q.shape[0], k.shape[0]
    mask = None
    if num_q != seq_len:
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
