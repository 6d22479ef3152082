"""Random paged caches and block tables shared by the attention tests."""

from __future__ import annotations

import torch
from helpers.paged import BlockAllocation


def random_paged_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (kv_cache, block_tables): shuffled blocks, -1 padded tables, spare blocks poisoned."""
    seed = int(torch.randint(2**31, (), generator=gen))
    alloc = BlockAllocation.shuffled(seq_lens, block_size, seed=seed)
    tables = alloc.block_tables
    cache = torch.randn(2, alloc.num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # a kernel that reads a block it does not own, or a slot past seq_len, sees NaN
    spare = torch.ones(alloc.num_blocks, dtype=torch.bool)
    spare[tables[tables >= 0].long()] = False
    cache[:, spare] = float("nan")
    for i, n in enumerate(seq_lens):
        if n % block_size:
            cache[:, tables[i, n // block_size], n % block_size:] = float("nan")
    return cache.to(dtype=dtype, device=device), tables.to(device)
