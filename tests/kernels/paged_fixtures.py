"""Random paged caches and block tables shared by the attention tests."""

from __future__ import annotations

import torch


def random_paged_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: str, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (kv_cache, block_tables): shuffled blocks, -1 padded tables, spare blocks poisoned."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(1, *blocks_per_seq)
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = order[used:used + nb].int()
        used += nb
    # a kernel that reads a block it does not own, or a slot past seq_len, sees NaN
    cache[:, order[used:]] = float("nan")
    for i, n in enumerate(seq_lens):
        if n % block_size:
            cache[:, tables[i, n // block_size], n % block_size:] = float("nan")
    return cache.to(dtype=dtype, device=device), tables.to(device)
