"""The torch reference attention backend: paged KV writes and per-sequence SDPA.

Correct on any device and reasonably quick on CPU: decode rows (query_len 1) of
all sequences go through one padded SDPA call; each prefill chunk gets its own
call with an explicit causal mask offset by the tokens already cached.
"""

from __future__ import annotations

import torch
from kvpilot.engine.attention.metadata import AttentionMetadata
from torch.nn import functional as F


class TorchAttentionBackend:
    """Implements `AttentionBackend` with plain torch ops."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Gives the attention output [T, num_heads, head_dim] after caching this step's k, v."""
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        query_lens = meta.query_lens_cpu or meta.query_start_loc.diff().tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        starts = meta.query_start_loc.tolist() if meta.query_lens_cpu is None else _cumsum(
            query_lens)
        out = torch.empty_like(q)
        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        if decodes:
            rows = torch.tensor([starts[i] for i in decodes], device=q.device)
            out[rows] = _decode(q[rows], kv_cache, meta.block_tables[decodes],
                                [seq_lens[i] for i in decodes], scale)
        for i, n in enumerate(query_lens):
            if n > 1:
                rows = slice(starts[i], starts[i] + n)
                out[rows] = _prefill(q[rows], kv_cache, meta.block_tables[i], seq_lens[i], scale)
        return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Stores k, v [T, kv_heads, d] at their slots; rows with slot -1 are not written."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor,
                   num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives one sequence's first `num_tokens` cached k and v, each [num_tokens, kv_heads, d]."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-num_tokens // block_size)].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:num_tokens]
    v = kv_cache[1, blocks].flatten(0, 1)[:num_tokens]
    return k, v


def _prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
             seq_len: int, scale: float) -> torch.Tensor:
    """Attention of one sequence's Q new rows over its seq_len cached positions; row j sees
    positions <= seq_len - Q + j."""
    num_q = q.shape[0]
    k, v = gather_context(kv_cache, block_table, seq_len)
    mask = None
    if num_q != seq_len:
        key_pos = torch.arange(seq_len, device=q.device)
        query_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: list[int], scale: float) -> torch.Tensor:
    """Attention of B single-token queries [B, heads, d], padded to the longest context."""
    block_size = kv_cache.shape[2]
    max_len = max(seq_lens)
    blocks = block_tables[:, : -(-max_len // block_size)].long().clamp(min=0)
    # [B, blocks, block_size, kv_heads, d] -> [B, kv_heads, padded_len, d]
    k = kv_cache[0, blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
    v = kv_cache[1, blocks].flatten(1, 2).transpose(1, 2).to(q.dtype)
    lens = torch.tensor(seq_lens, device=q.device)
    mask = (torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None])[:, None, :, None]
    # Padding slots hold whatever the cache had (even NaN); a masked score times a NaN
    # value would still be NaN, so zero them.
    k, v = k.masked_fill(~mask, 0), v.masked_fill(~mask, 0)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask.transpose(2, 3), scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _cumsum(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts
