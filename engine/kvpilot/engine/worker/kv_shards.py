"""Writing whole-head KV blocks into one rank's shard of the cache (heterogeneous TP).

A block in the wire layout holds every KV head ([num_layers, 2, block_size,
num_kv_heads, head_dim], as bytes), the layout of a TP=1 prefill engine. A
tensor-parallel rank keeps only its heads (`TPGroup.kv_heads`: its share, or the one
head it replicates), so a load re-shards each block by KV head on the way in.
"""

from __future__ import annotations

import torch

from kvpilot.kernels.kv_cache_dtype import as_bytes


def write_blocks(caches: list[torch.Tensor], block_ids: torch.Tensor, data: torch.Tensor,
                 heads: slice, num_kv_heads: int) -> None:
    """Writes this rank's `heads` of whole-head blocks (uint8 [n, block_bytes]) into the
    per-layer caches ([2, num_blocks, block_size, local_heads, head_dim]) at `block_ids`."""
    caches = [as_bytes(c) for c in caches]  # fp8 rows move as bytes (CPU cannot index fp8)
    first = caches[0]
    _, _, block_size, _, head_dim = first.shape
    blocks = data.view(first.dtype).view(len(block_ids), len(caches), 2, block_size,
                                         num_kv_heads, head_dim)[..., heads, :]
    for layer, cache in enumerate(caches):
        cache.index_copy_(1, block_ids, blocks[:, layer].transpose(0, 1))


def whole_block_bytes(caches: list[torch.Tensor], num_kv_heads: int) -> int:
    """Gives the bytes of one block with every KV head, from one rank's caches."""
    first = caches[0]
    _, _, block_size, _, head_dim = first.shape
    return len(caches) * 2 * block_size * num_kv_heads * head_dim * first.element_size()
